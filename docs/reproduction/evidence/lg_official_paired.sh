#!/usr/bin/env bash
# Evidence: the official LG-FedAvg main_fed.py trained on our split with our client draws, paired
# with the committed fedavg_nodecay run of the same seed (docs/reproduction/lg_table1_cifar10).
#
#   lg_official_paired.sh SEED [ROUNDS] [RUN] [INIT]
#
# Needs lg_official_fedavg.sh's scratch folder ($SCRATCH, default /tmp/official-lg: the official
# code and the copy as CIFAR pickles). official_paired.py writes our seed's split (in the
# pickles' order, checked image by image) and the clients of each of its rounds; a copy of
# main_fed.py (main_fed_paired.py, scratch only) reads them instead of drawing its own. All else is
# the official code: its model initialisation, input pipeline, local training and averaging
# (unseeded, so a second run of a seed shows the spread of the rest). ROUNDS: default 1850 (the
# cell's). RUN: default paired-seedSEED. INIT: official (default) or ours (our run's initial
# weights, under the official layer names). Output: the official results.csv under
# $SCRATCH/code/save/.../RUN/fed/.
set -euo pipefail
seed=${1:?usage: lg_official_paired.sh SEED [ROUNDS] [RUN] [INIT]}
rounds=${2:-1850}
run=${3:-paired-seed$seed}
init=${4:-official}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
py=${PYTHON:-python3}
s=${SCRATCH:-/tmp/official-lg}
case $init in
  official) init_pt=""; init_args=() ;;
  ours) init_pt="$s/$run-init.pt"; init_args=(--init "$init_pt") ;;
  *) echo "INIT=$init: expected official or ours" >&2; exit 2 ;;
esac
[ -f "$s/code/main_fed.py" ] && [ -f "$s/cifar-10-batches-py/test_batch" ] ||
  { echo "$s: run lg_official_fedavg.sh first (the official code and the CIFAR pickles)" >&2; exit 2; }
run_dir="$repo/docs/reproduction/lg_table1_cifar10/runs/fedavg_nodecay/seed$seed"
[ -f "$run_dir/config.yaml" ] || { echo "$run_dir: no committed fedavg_nodecay run of seed $seed" >&2; exit 2; }
(cd "$repo" && PYTHONPATH="$repo" "$py" "$here/official_paired.py" "$run_dir" "$s/cifar-10-batches-py" "$s/$run.json" "${init_args[@]}")
"$py" - "$s/code" <<'PY'
import sys
from pathlib import Path

code = Path(sys.argv[1])
text = (code / "main_fed.py").read_text()
for old, new in [
    ("    dataset_train, dataset_test, dict_users_train, dict_users_test = get_data(args)\n",
     "    dataset_train, dataset_test, dict_users_train, dict_users_test = get_data(args)\n"
     "    import json  # paired: our split and client draws (lg_official_paired.sh)\n"
     "    paired = json.load(open(os.environ['PAIRED_JSON']))\n"
     "    dict_users_train = {i: np.array(v) for i, v in enumerate(paired['dict_users_train'])}\n"),
    ("        idxs_users = np.random.choice(range(args.num_users), m, replace=False)\n",
     "        idxs_users = np.array(paired['clients'][iter])\n"),
    ("    net_glob = get_model(args)\n",
     "    net_glob = get_model(args)\n"
     "    if os.environ.get('PAIRED_INIT'):  # paired: our run's initial weights\n"
     "        net_glob.load_state_dict(torch.load(os.environ['PAIRED_INIT']))\n"),
]:
    assert text.count(old) == 1, f"main_fed.py: the line to change is not there once: {old!r}"
    text = text.replace(old, new)
(code / "main_fed_paired.py").write_text(text)
PY
cd "$s/code"
PAIRED_JSON="$s/$run.json" PAIRED_INIT="$init_pt" PYTHONPATH="$s/deps" "$py" -u main_fed_paired.py --dataset cifar10 --model cnn \
  --num_classes 10 --epochs "$rounds" --lr 0.1 --num_users 100 --shard_per_user 2 --frac 0.1 --local_ep 1 \
  --local_bs 50 --test_freq 1 --gpu -1 --results_save "$run"

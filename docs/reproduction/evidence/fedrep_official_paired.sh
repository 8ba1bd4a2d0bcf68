#!/usr/bin/env bash
# Evidence: the official FedRep code's Per-FedAvg path (main_fedrep.py --alg maml) trained on our
# split with our client draws, paired with a committed perfedavg_officialpath_ft run of the same
# seed (docs/reproduction/fedrep_table1_cifar10).
#
#   fedrep_official_paired.sh CELL SEED LOCAL_EP [ROUNDS] [RUN] [INIT] [DRAWS]
#
# Needs fedrep_official_maml.sh's scratch folder ($SCRATCH, default /tmp/official-fedrep-maml: the
# official code and the copy as CIFAR pickles). official_paired.py writes the run's split (train
# and local test, in the pickles' order, checked image by image) and the clients of each of its
# rounds; a copy of main_fedrep.py (main_fedrep_paired.py, scratch only) reads them instead of
# drawing its own (its final round, where every client trains, keeps the official draw). All else
# is the official code: input pipeline, local training, averaging, evaluation. CELL: a committed
# cell of that path, e.g. perfedavg_officialpath_ft_ep5_100x5; LOCAL_EP: its local epochs (5 there).
# ROUNDS: default 100. RUN: default paired-CELL-seedSEED. INIT: official (default: the official,
# unseeded initialisation) or ours (the run's initial weights, under the official layer names).
# DRAWS: both (default: our split and our clients), split (our split, the official code's own
# client draws), clients (the official code's own split, our clients of each round) or none (a
# control: the patched copy with all its own draws, i.e. the official code).
# Output: the log $SCRATCH/RUN.log (each round's mean local test accuracy, 'Final Round').
set -euo pipefail
cell=${1:?usage: fedrep_official_paired.sh CELL SEED LOCAL_EP [ROUNDS] [RUN] [INIT] [DRAWS]}
seed=${2:?SEED: a committed seed of CELL}
local_ep=${3:?LOCAL_EP: local epochs of CELL}
rounds=${4:-100}
run=${5:-paired-$cell-seed$seed}
init=${6:-official}
draws=${7:-both}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
py=${PYTHON:-python3}
s=${SCRATCH:-/tmp/official-fedrep-maml}
case $init in
  official) init_pt=""; init_args=() ;;
  ours) init_pt="$s/$run-init.pt"; init_args=(--init "$init_pt") ;;
  *) echo "INIT=$init: expected official or ours" >&2; exit 2 ;;
esac
case $draws in both|split|clients|none) ;; *) echo "DRAWS=$draws: expected both, split, clients or none" >&2; exit 2 ;; esac
[ -f "$s/code/main_fedrep.py" ] && [ -f "$s/cifar-10-batches-py/test_batch" ] ||
  { echo "$s: run fedrep_official_maml.sh first (the official code and the CIFAR pickles)" >&2; exit 2; }
run_dir="$repo/docs/reproduction/fedrep_table1_cifar10/runs/$cell/seed$seed"
[ -f "$run_dir/config.yaml" ] || { echo "$run_dir: no committed run" >&2; exit 2; }
shards=$(grep -m1 "^  shards_per_client:" "$run_dir/config.yaml" | awk '{print $2}')
(cd "$repo" && PYTHONPATH="$repo" "$py" "$here/official_paired.py" "$run_dir" "$s/cifar-10-batches-py" "$s/$run.json" "${init_args[@]}")
"$py" - "$s/code" <<'PY'
import sys
from pathlib import Path

code = Path(sys.argv[1])
text = (code / "main_fedrep.py").read_text()
for old, new in [
    ("        dataset_train, dataset_test, dict_users_train, dict_users_test = get_data(args)\n",
     "        dataset_train, dataset_test, dict_users_train, dict_users_test = get_data(args)\n"
     "        import json, os  # paired: our split and client draws (fedrep_official_paired.sh)\n"
     "        paired = json.load(open(os.environ['PAIRED_JSON']))\n"
     "        if os.environ['PAIRED_DRAWS'] in ('both', 'split'):\n"
     "            dict_users_train = {i: np.array(v) for i, v in enumerate(paired['dict_users_train'])}\n"
     "            dict_users_test = {i: np.array(v) for i, v in enumerate(paired['dict_users_test'])}\n"),
    ("        idxs_users = np.random.choice(range(args.num_users), m, replace=False)\n",
     "        idxs_users = np.array(paired['clients'][iter]) if iter < args.epochs and "
     "os.environ['PAIRED_DRAWS'] in ('both', 'clients') else "
     "np.random.choice(range(args.num_users), m, replace=False)\n"),
    ("    net_glob = get_model(args)\n",
     "    net_glob = get_model(args)\n"
     "    if os.environ.get('PAIRED_INIT'):  # paired: our run's initial weights\n"
     "        net_glob.load_state_dict(torch.load(os.environ['PAIRED_INIT']))\n"),
]:
    assert text.count(old) == 1, f"main_fedrep.py: the line to change is not there once: {old!r}"
    text = text.replace(old, new)
(code / "main_fedrep_paired.py").write_text(text)
PY
cd "$s/code"
PAIRED_JSON="$s/$run.json" PAIRED_DRAWS="$draws" PAIRED_INIT="$init_pt" "$py" -u main_fedrep_paired.py --dataset cifar10 --model cnn \
  --num_classes 10 --alg maml --lr 0.01 --num_users 100 --shard_per_user "$shards" --frac 0.1 --local_bs 10 \
  --local_ep "$local_ep" --epochs "$rounds" --gpu -1 > "$s/$run.log" 2>&1
grep -E "^Round +[0-9]+,|^Final Round|^Average accuracy" "$s/$run.log" | tail -13

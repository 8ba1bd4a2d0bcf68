#!/usr/bin/env bash
# Evidence: the official FedRep code's Per-FedAvg path (lgcollins/FedRep main_fedrep.py --alg maml)
# on this machine's CIFAR-10 copy, to set beside our perfedavg_officialpath_ft cells
# (docs/reproduction/fedrep_table1_cifar10).
#
#   fedrep_official_maml.sh GIT_DIR SHARDS LOCAL_EP [RUN] [ROUNDS]
#
# GIT_DIR: a git directory of lgcollins/FedRep (the search tool's `fetch github:lgcollins/FedRep`).
# SHARDS: classes per client (2 or 5); LOCAL_EP: local epochs (1: the official FedAvg scripts';
# 5: the paper's text and the code's default). Settings: FedRep Table 1's CIFAR-10 (100 clients,
# 10% a round, batch 10, lr 0.01, ROUNDS default 100), tested every round (the code's default).
# The code prints each round's mean local test accuracy, 'Average accuracy final 10 rounds' and,
# after its final round (every client trains its own model once more), 'Final Round'.
# Scratch only ($SCRATCH, default /tmp/official-fedrep-maml): the code (git archive), the copy as
# CIFAR pickles (../shared/bench/cifar_jpeg_to_pickles.py), the log $SCRATCH/RUN.log. Two
# scratch-only fixes, as ../shared/bench/official_fedrep.sh: a tab in models/test.py, and
# torchvision's checksum check. The official code seeds nothing.
# ORDER=names (environment; use its own SCRATCH, which a plain run then refuses): the pickles
# re-written (again, harmlessly, on every such run) with each class's images
# in file-name order, our data order, so that the official split cuts its shards from consecutive
# files as ours does (the bench script writes them in a fixed random order).
set -euo pipefail
git_dir=${1:?usage: fedrep_official_maml.sh GIT_DIR SHARDS LOCAL_EP [RUN] [ROUNDS]}
shards=${2:?SHARDS: 2 or 5}
local_ep=${3:?LOCAL_EP: local epochs}
run=${4:-maml_${shards}shards_ep${local_ep}}
rounds=${5:-100}
here=$(cd "$(dirname "$0")" && pwd)
shared=${SHARED:-$here/../../../../shared}
py=${PYTHON:-python3}
s=${SCRATCH:-/tmp/official-fedrep-maml}
mkdir -p "$s/code" "$s/untar" "$s/cifar-10-batches-py"
if [ ! -f "$s/code/main_fedrep.py" ]; then
  git --git-dir="$git_dir" archive HEAD | tar x -C "$s/code"
  sed -i '108s/^\t/        /' "$s/code/models/test.py"
  sed -i '7a from torchvision import datasets as _ds\n_ds.cifar.check_integrity = lambda *a, **k: True\n_ds.CIFAR10._check_integrity = lambda self: True' "$s/code/utils/train_utils.py"
fi
if [ ! -f "$s/cifar-10-batches-py/test_batch" ]; then
  tar xf "$shared/datasets/cifar10-jpeg/CIFAR-10-images-jpeg.tar" -C "$s/untar"
  "$py" "$shared/bench/cifar_jpeg_to_pickles.py" "$s/untar" "$s/cifar-10-batches-py"
fi
if [ "${ORDER:-}" = names ]; then "$py" - "$s/cifar-10-batches-py" <<'PY'
import pickle, sys
import numpy as np

folder = sys.argv[1]
for files in ([f"data_batch_{b}" for b in range(1, 6)], ["test_batch"]):
    batches = [pickle.load(open(f"{folder}/{f}", "rb"), encoding="latin1") for f in files]
    names = np.array([n for b in batches for n in b["filenames"]])  # '<class>_<file>'
    data, labels = np.concatenate([b["data"] for b in batches]), np.array([y for b in batches for y in b["labels"]])
    order = np.argsort(names, kind="stable")
    assert (np.diff(labels[order]) >= 0).all(), "name order is not class order"
    for f, part in zip(files, np.array_split(order, len(files))):
        batch = {"batch_label": f"{f} in file-name order", "labels": labels[part].tolist(), "data": data[part],
                 "filenames": names[part].tolist()}
        pickle.dump(batch, open(f"{folder}/{f}", "wb"))
PY
elif grep -q "in file-name order" "$s/cifar-10-batches-py/test_batch"; then
  echo "$s: its pickles are in file-name order (ORDER=names); use another SCRATCH" >&2; exit 2
fi
mkdir -p "$s/code/data/cifar10" "$s/code/save"
ln -sfn "$s/cifar-10-batches-py" "$s/code/data/cifar10/cifar-10-batches-py"
cd "$s/code"
"$py" -u main_fedrep.py --dataset cifar10 --model cnn --num_classes 10 --alg maml --lr 0.01 \
  --num_users 100 --shard_per_user "$shards" --frac 0.1 --local_bs 10 --local_ep "$local_ep" \
  --epochs "$rounds" --gpu -1 > "$s/$run.log" 2>&1
grep -E "^Round +[0-9]+,|^Final Round|^Average accuracy" "$s/$run.log" | tail -13

#!/usr/bin/env bash
# Evidence: the official LG-FedAvg FedAvg (pliang279/LG-FedAvg main_fed.py) on this machine's
# CIFAR-10 copy, to set beside our fedavg_nodecay cell (docs/reproduction/lg_table1_cifar10).
#
#   lg_official_fedavg.sh GIT_DIR [ROUNDS] [RUN]
#
# GIT_DIR: a git directory of pliang279/LG-FedAvg (the search tool's `fetch github:pliang279/LG-FedAvg`).
# ROUNDS: default 2000 (the official scripts/main_fed_cifar10.sh). RUN: a name for the results
# folder (default run1). Settings: the script's (--lr 0.1 --local_ep 1 --local_bs 50 --frac 0.1,
# 100 users x 2 shards), tested every round (--test_freq 1, the paper-era default). Output: the
# official results.csv (epoch, loss_avg, loss_test, acc_test, best_acc) under $SCRATCH/code/save/.
# Scratch only ($SCRATCH, default /tmp/official-lg): the code (git archive), the JPEG copy as
# CIFAR pickles (../shared/bench/cifar_jpeg_to_pickles.py), pandas (main_fed.py imports it).
# One scratch-only change: torchvision's checksum check is skipped (the copy's md5s cannot match).
# The official code seeds nothing: every run draws its own split and clients.
set -euo pipefail
git_dir=${1:?usage: lg_official_fedavg.sh GIT_DIR [ROUNDS] [RUN]}
rounds=${2:-2000}
run=${3:-run1}
here=$(cd "$(dirname "$0")" && pwd)
shared=${SHARED:-$here/../../../../shared}
py=${PYTHON:-python3}
s=${SCRATCH:-/tmp/official-lg}
mkdir -p "$s/code" "$s/untar" "$s/cifar-10-batches-py" "$s/deps"
if [ ! -f "$s/code/main_fed.py" ]; then
  git --git-dir="$git_dir" archive HEAD main_fed.py models utils | tar x -C "$s/code"
  sed -i '1a from torchvision import datasets as _ds\n_ds.cifar.check_integrity = lambda *a, **k: True\n_ds.CIFAR10._check_integrity = lambda self: True' "$s/code/utils/train_utils.py"
fi
if [ ! -f "$s/cifar-10-batches-py/test_batch" ]; then
  tar xf "$shared/datasets/cifar10-jpeg/CIFAR-10-images-jpeg.tar" -C "$s/untar"
  "$py" "$shared/bench/cifar_jpeg_to_pickles.py" "$s/untar" "$s/cifar-10-batches-py"
fi
"$py" -c "import pandas" 2>/dev/null || [ -d "$s/deps/pandas" ] || "$py" -m pip install -q --target "$s/deps" pandas
mkdir -p "$s/code/data/cifar10"
ln -sfn "$s/cifar-10-batches-py" "$s/code/data/cifar10/cifar-10-batches-py"
cd "$s/code"
PYTHONPATH="$s/deps" "$py" -u main_fed.py --dataset cifar10 --model cnn --num_classes 10 --epochs "$rounds" \
  --lr 0.1 --num_users 100 --shard_per_user 2 --frac 0.1 --local_ep 1 --local_bs 50 --test_freq 1 \
  --gpu -1 --results_save "$run"

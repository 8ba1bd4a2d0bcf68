#!/usr/bin/env bash
# Evidence: one of our runs with the official input pipeline of LG-FedAvg and FedRep (FedRep's
# utils/train_utils.py copies LG-FedAvg's), to pair with the committed run of the same command.
#
#   official_pipeline.sh OUT EXPERIMENT [OVERRIDE...]    # flrep run's arguments, seed included
#
# The official code pads crops with black pixels (torchvision's RandomCrop before Normalize) and
# normalises with ImageNet's mean/std; this repo pads with the mean colour (zeros after
# normalising) and normalises with the train split's mean/std. The script checks out this repo's
# HEAD into $SCRATCH (default /tmp/official-pipeline; once: delete $SCRATCH/code to refresh it),
# changes those two things there only (normalize_images: ImageNet statistics; crop_flip: black
# padding) and runs `flrep run EXPERIMENT OVERRIDE... 'compare=[]'` from that copy (PYTHONPATH, so
# the Ray workers import it too), with its own data cache (the partition cache is keyed by the
# config, not by the code). The split, clients and every other draw are the committed run's of the
# same seed. Give the cell's overrides at its table scale too (reproduce's command line): the
# committed run's config.yaml and $SCRATCH/OUT/config.yaml must differ in paths only. Output:
# $SCRATCH/OUT.
set -euo pipefail
out=${1:?usage: official_pipeline.sh OUT EXPERIMENT [OVERRIDE...]}
experiment=${2:?usage: official_pipeline.sh OUT EXPERIMENT [OVERRIDE...]}
shift 2
repo=$(cd "$(dirname "$0")/../../.." && pwd)
s=${SCRATCH:-/tmp/official-pipeline}
mkdir -p "$s"
if [ ! -d "$s/code" ]; then
  mkdir "$s/code"
  git -C "$repo" archive HEAD flower_app strategies task conf pyproject.toml | tar x -C "$s/code"
  python - "$s/code" <<'EOF'
import sys
from pathlib import Path

def patch(rel: str, old: str, new: str) -> None:
    path = Path(sys.argv[1], rel)
    text = path.read_text()
    assert text.count(old) == 1, f"{rel}: the line to change is not there once"
    path.write_text(text.replace(old, new))

patch("task/data/datasets/images.py", "    std[std < 1e-12] = 1.0\n",
      "    std[std < 1e-12] = 1.0\n"
      "    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])  # official: ImageNet's\n")
patch("task/learning/engine.py", "    padded = F.pad(x, (padding, padding, padding, padding))\n",
      "    black = torch.tensor([-0.485 / 0.229, -0.456 / 0.224, -0.406 / 0.225], device=x.device).view(1, 3, 1, 1)\n"
      "    padded = F.pad(x - black, (padding, padding, padding, padding)) + black  # official: black padding\n")
EOF
fi
cd "$s/code"
PYTHONPATH="$s/code" python -m flower_app.cli run "$experiment" "$@" 'compare=[]' data.cache_dir="$s/cache" \
  --out "$s/$out"

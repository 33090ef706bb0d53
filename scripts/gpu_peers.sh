#!/usr/bin/env bash
# The peers a lent GPU machine cannot download (it has no network): GemLite's sdist from PyPI,
# unpacked under .gpu_peers/ (ignored by git), which the GPU run carries with the checkout and
# scripts/gpu_check.sh puts on PYTHONPATH. GemLite is pure Python + Triton (it needs Triton >= 3.6,
# numpy, tqdm), so its source runs as it is; torch's int4 kernel ships with torch.
#
#   bash scripts/gpu_peers.sh            # then carry .gpu_peers (about 1 MB)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
gemlite=${GEMLITE_VERSION:-0.6.0.post2}
dest="$repo/.gpu_peers"
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download --quiet --no-deps --no-binary :all: "gemlite==$gemlite" -d "$tmp"
rm -rf "$dest/gemlite-$gemlite"
tar -xzf "$tmp/gemlite-$gemlite.tar.gz" -C "$dest"
test -f "$dest/gemlite-$gemlite/gemlite/core.py"
echo "gemlite $gemlite: $dest/gemlite-$gemlite (carry .gpu_peers; $(du -sh "$dest" | cut -f1))"

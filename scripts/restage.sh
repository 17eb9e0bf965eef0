#!/usr/bin/env bash
# Re-split the SGLang stage (../shared/gpu/stage-sglang.sh's .stage/part-NN) into parts that fit beside this
# repository under the device tool's 64-MiB carry limit, and set install.sh's part count to match. The bundle (and so
# install.sh's checksum) is unchanged: only where it is cut moves. The records make the tracked tree grow each GPU
# session (46.8 MiB after 2026-12-03's, where 16-MiB parts stopped fitting and the tool refused the call).
# The tool counts more than the files' bytes: 46.34 MiB of tracked files and a 16-MiB part went (2026-12-03), 46.80
# and 16 were refused, 46.80 and 14 went; so this plans for 62 MiB of files and part, less the headroom.
# usage: bash scripts/restage.sh [STAGE_DIR (default .stage)] [HEADROOM_MIB (default 1)]
# prints the part size and count; each part costs one device call (~4 s of the lease).
set -euo pipefail
stage=${1:-.stage}; headroom=${2:-1}
[ -f "$stage/install.sh" ] && ls "$stage"/part-* > /dev/null 2>&1 || { echo "no stage in $stage: run ../shared/gpu/stage-sglang.sh $stage first" >&2; exit 1; }
# what travels with every call: tracked files and untracked ones git does not ignore, plus install.sh
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
inst=$(stat -c %s "$stage/install.sh")
part=$(( (62 << 20) - tree - inst - (headroom << 20) ))
[ "$part" -ge $((4 << 20)) ] || { echo "the tree is $((tree >> 20)) MiB: under 4 MiB would be left for a part; make the tree smaller" >&2; exit 1; }
part=$(( part >> 20 ))  # whole MiB
bundle=$(mktemp -p "$stage" bundle.XXXX)
cat "$stage"/part-* > "$bundle"
rm "$stage"/part-*
split -b "${part}M" -d -a 2 "$bundle" "$stage/part-"
rm "$bundle"
n=$(ls "$stage"/part-* | wc -l)
sed -i "s/^want=[0-9]*$/want=$n/" "$stage/install.sh"
echo "tree $((tree >> 20)) MiB: $n parts of $part MiB in $stage (install.sh want=$n)"

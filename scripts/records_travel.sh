#!/usr/bin/env bash
# Whether outputs/records travels with each device call. Every call carries the tracked tree (64 MiB at most, the
# stage's part included), and the records are most of it (52 of 62 MiB on 2026-12-05: the stage then went in 37 parts
# of 8 MiB, a device call each, ~15 s of the lease each). No phase on the GPU reads them.
#   off: untrack them in the index only (the files stay; outputs/records/.gitignore, itself ignored, ignores them, as
#        .git/info/exclude cannot: the root .gitignore's !outputs/records/ outranks it): the tree that travels is a few
#        MiB, and scripts/restage.sh cuts the stage into ~6 parts. Commit nothing while off.
#   on:  track them again, as HEAD has them (run it right after the device calls, before any commit).
# usage: bash scripts/records_travel.sh off|on|status
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
gi=outputs/records/.gitignore
case "${1:-status}" in
  off) git diff --cached --quiet -- outputs/records || { echo "staged changes under outputs/records: commit them first" >&2; exit 1; }
       git rm -r -q --cached outputs/records
       echo '*' > "$gi"
       echo "records untracked for the device calls: run 'bash scripts/records_travel.sh on' before committing" ;;
  on)  rm -f "$gi"
       git reset -q -- outputs/records
       echo "records tracked again ($(git ls-files outputs/records | wc -l) files)" ;;
  status) if [ -f "$gi" ]; then echo off; else echo on; fi ;;
  *) echo "usage: $0 off|on|status" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter (ArviZ 1.x needs 3.12+).
# Tries python3.12 on PATH, pyenv's 3.12 install, then python3 if it is new enough.
set -u
ok() { "$@" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
for cand in python3.12 python3.13 python3; do
  if command -v "$cand" >/dev/null 2>&1 && ok "$cand"; then
    "$cand" -c 'import sys; print(sys.executable)'; exit 0
  fi
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for exe in "$root"/versions/3.12*/bin/python3.12 "$root"/versions/3.13*/bin/python3.13; do
    if [ -x "$exe" ] && ok "$exe"; then echo "$exe"; exit 0; fi
  done
fi
for exe in /usr/bin/python3.12 /usr/local/bin/python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
  if [ -x "$exe" ] && ok "$exe"; then echo "$exe"; exit 0; fi
done
echo "error: no Python >= 3.12 found (needed by ArviZ 1.x); install python3.12" >&2
exit 1

#!/bin/bash
# The default model's step programs (HLO before XLA's passes), one hash each, to show a refactor changed no program:
#   scripts/program_hashes.sh OUT            # then: diff OUT_A/hashes_tp1.txt OUT_B/hashes_tp1.txt (and tp8, dp2tp2pp2)
# Runs scripts/generate.py (two prompts, 8 tokens, no compile cache) at tp 8, dp 2 x tp 2 x pp 2 and tp 1 on 8 simulated
# devices with XLA_FLAGS' dump; each module's hash leaves out where its ops came from (metadata, the file, function
# and stack-frame tables), which moves with every edited line and with the checkout's path.
set -euo pipefail
out=$(realpath -m "$1"); root=$(cd "$(dirname "$0")/.." && pwd); python=${PYTHON:-$root/.venv/bin/python}
rm -rf "$out"; mkdir -p "$out"
for cfg in "--tp 8" "--dp 2 --tp 2 --pp 2" "--tp 1"; do
  name=$(echo "$cfg" | tr -d ' -')
  (cd "$root" && XLA_FLAGS="--xla_dump_to=$out/raw_$name --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=NONE" \
     "$python" scripts/generate.py --simulate-devices 8 $cfg --prompt "Once upon a time" --prompt "Hi there" \
     --max-tokens 8 --no-compile-cache > "$out/generate_$name.txt" 2>&1)
  for f in "$out/raw_$name"/*before_optimizations.txt; do
    module=$(basename "$f" | sed -E 's/^module_[0-9]+\.//; s/\.before_optimizations\.txt//')
    sed -E 's/, metadata=\{[^}]*\}//g; s/^HloModule [^ ,]+/HloModule M/' "$f" \
      | grep -vE '^(FileNames|FunctionNames|FileLocations|StackFrames)$|^[0-9]+ ("|\{)' | md5sum | cut -c1-12 \
      | sed "s|\$| $module|"
  done | sort > "$out/hashes_$name.txt"
  echo "$name: $(wc -l < "$out/hashes_$name.txt") programs, $(tail -1 "$out/generate_$name.txt")"
done

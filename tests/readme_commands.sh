#!/usr/bin/env bash
# Runs every dsrun command of the README as written, on this machine (CI's has 2 cores), in a
# scratch directory with its own run store and a copy of recipes/ (its runs shortened). The
# README's example run ids are placeholders: 3fa9 and 7c1e stand for runs made here (a `resume`
# gets a run stopped with Ctrl-C, as the README says it is for). Fails on the first command that
# fails. Usage: tests/readme_commands.sh [README]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
readme=${1:-$root/README.md}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
ln -s "$root/build" build
# The recipes as shipped, but the runs shortened: the commands are what is tested here (the hook,
# sweep and autotuner recipes have tests of their own), and CI has 2 cores. The quickstart (which
# most commands train, resume or base on) 200 -> 60 steps, the early-stop example 400 -> 100, the
# autotuner's 18 trials 12 -> 6 steps each.
cp -r "$root/recipes" recipes
shorten() {  # shorten FILE FROM TO
  sed -i "s/^steps = $2\$/steps = $3/" "$1"
  grep -q "^steps = $3\$" "$1" || { echo "readme_commands: $1 has no 'steps = $2' line to shorten" >&2; exit 1; }
}
shorten recipes/quickstart.toml 200 60
shorten recipes/hooks/early_stop.toml 400 100
shorten recipes/sweeps/autotune.toml 12 6
export DSRUN_DB="$work/runs/dsrun.db"

# The README's commands: lines of its shell blocks that call ./build/dsrun, comments dropped.
mapfile -t commands < <(awk '/^```sh/{on=1; next} /^```/{on=0} on' "$readme" | grep -o '\./build/dsrun[^#]*' | sed 's/[[:space:]]*$//')
[ "${#commands[@]}" -ge 10 ] || { echo "readme_commands: found only ${#commands[@]} commands in $readme" >&2; exit 1; }

run_id_of() { grep -o '^run [0-9a-f]\{8\}' "$1" | head -n 1 | cut -c5-; }

# A quickstart run stopped with Ctrl-C (SIGINT) once it has trained a few steps: what `resume` is for.
stopped_run() {
  local log="$work/stopped.$RANDOM.log"
  ./build/dsrun recipes/quickstart.toml > "$log" 2>&1 &
  local pid=$! id="" step=0
  for _ in $(seq 1 600); do
    id=$(run_id_of "$log" || true)
    if [ -n "$id" ]; then
      step=$(sqlite3 "$DSRUN_DB" "select coalesce(max(step), 0) from metrics where run_id = '$id' and key = 'loss'" 2>/dev/null || echo 0)
      [ "$step" -ge 20 ] && break
    fi
    sleep 0.1
  done
  kill -INT "$pid"
  wait "$pid" || true  # a stopped run exits 130
  [ -n "$id" ] || { cat "$log" >&2; exit 1; }
  echo "$id"
}

first="" second=""
for command in "${commands[@]}"; do
  case "$command" in
    *" resume 3fa9"*) command=${command//3fa9/$(stopped_run)} ;;
    *) command=${command//3fa9/$first}; command=${command//7c1e/$second} ;;
  esac
  echo "+ $command"
  log="$work/command.log"
  start=$(date +%s)
  if ! eval "$command" > "$log" 2>&1; then
    cat "$log"
    echo "readme_commands: FAILED: $command" >&2
    exit 1
  fi
  tail -n 3 "$log"
  echo "  ($(($(date +%s) - start)) s)"
  # The first two runs stand for the README's 3fa9 and 7c1e.
  if id=$(run_id_of "$log") && [ -n "$id" ]; then
    if [ -z "$first" ]; then first=$id; elif [ -z "$second" ]; then second=$id; fi
  fi
done
echo "readme_commands: ${#commands[@]} passed, 0 failed"

#!/usr/bin/env bash
# Runs every test of slimen: Go formatting and vet, the Go test suite, the race detector over the
# packages where rollouts, dispatchers and engine streams run concurrently, and the Python worker's
# pytest suite in a virtual environment cached outside the clone (scripts/pyenv.sh).
#
# The Go tests (go test, then the race run) and pytest go at the same time: one after another
# they kept a 2-core machine only two-thirds busy (18m20s of wall time for 24m of CPU: cmd/slimen's
# tests wait on the processes they start, pytest is one process). Two streams, not three: the
# torch worker tests wait 10-15 s for a worker's start, which a machine more loaded stretches.
# Each stream's output is printed whole when it ends, Go's first.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== gofmt"
unformatted=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$unformatted" ]; then
  echo "gofmt would change:"; echo "$unformatted"; exit 1
fi
echo "== go vet"
go vet ./...

# The environment first: the Go tests of the torch worker ask scripts/pyenv.sh for it too, and two
# of it creating the environment at once would remove each other's.
venv=$(scripts/pyenv.sh)

# The race detector runs these packages' tests; those of all but host run only there (the same
# tests, slower and checked for races). host's run without it too: some of its sandbox tests check
# memory bounds only without the race detector's runtime (raceEnabled).
race=$(go list ./host/... ./engines/remote ./engines/server ./engines/scripted ./engines/openai ./graphs ./starlib)
plain=$(go list ./... | grep -vxF -f <(printf '%s\n' $race | grep -vx 'github.com/slimen/slimen/host'))

logs=$(mktemp -d)
# On an interrupt the runs still going are stopped with the script. `|| true`: once every run has
# ended, `kill` with no process fails, and under `set -e` that would make the trap exit 2 after
# "all tests passed".
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$logs"' EXIT
start() { # start NAME COMMAND...: runs the command in the background, its output in $logs/NAME
  local name=$1; shift
  ( "$@" >"$logs/$name" 2>&1 ) &
  pids[$name]=$!
}
go_tests() { # both Go runs, the second even when the first fails; fails if either did
  set +e
  echo "== go test"
  go test -count=1 -timeout 15m $plain
  local rc=$?
  echo "== go test -race (the packages where rollouts, dispatchers and engine streams run concurrently)"
  go test -race -count=1 -timeout 15m $race || rc=1
  return $rc
}
declare -A pids
start "go tests" go_tests
if [ -d engines/torch/tests ]; then
  start "python worker tests" bash -c "cd engines/torch && exec '$venv/bin/python' -m pytest -q tests"
fi

failed=()
for name in "go tests" "python worker tests"; do
  [ -n "${pids[$name]:-}" ] || continue
  set +e
  wait "${pids[$name]}"
  rc=$?
  set -e
  echo "== $name"
  cat "$logs/$name"
  # pytest exits 5 when it collects no tests: that is a failure of the suite, not a pass.
  if [ $rc -ne 0 ]; then
    echo "== $name failed (exit status $rc)"
    failed+=("$name")
  fi
done
if [ ${#failed[@]} -ne 0 ]; then
  echo "== failed: ${failed[*]}"
  exit 1
fi
echo "== all tests passed"

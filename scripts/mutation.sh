#!/usr/bin/env bash
# Mutation testing with mutmut (not part of CI: it takes an hour or more).
#
#   bash scripts/mutation.sh [TARGET ...]
#
# TARGET: scorers, budget, tree, global_store, sam, stop_rule, drafter (default:
# all seven, in that order). Each target is mutated in its own copy of the tracked tree under
# ${MUTATION_WORKDIR:-/tmp/specplug-mutation}/TARGET (the checkout is never
# touched), with the fast tier's settings (SPECPLUG_FAST_TESTS=1, no engine,
# server or slow tests) and only the test files that exercise the target as the
# test command; mutmut runs, for each mutant, only the tests that reach the
# mutated function. Results go to results/mutation/$(date +%F)/TARGET.txt (one
# line per mutant: name and status) and TARGET.summary (counts and score).
# Inspect a survivor: cd $MUTATION_WORKDIR/TARGET && mutmut show NAME.
# MUTATION_CHILDREN (default 2): parallel test processes.
# docs/testing.md has the scores and the triage of survivors.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
MUTMUT_VERSION=3.8.1
if ! "$PY" -c "import mutmut, sys; sys.exit(mutmut.__version__ != '$MUTMUT_VERSION')" 2>/dev/null; then
  "$PY" -m pip install -q "mutmut==$MUTMUT_VERSION"
fi
WORK=${MUTATION_WORKDIR:-/tmp/specplug-mutation}
OUT=$ROOT/results/mutation/$(date +%F)
mkdir -p "$OUT" "$WORK"

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(scorers budget tree global_store sam stop_rule drafter)

for target in "${targets[@]}"; do
  case $target in
    scorers) files="vllm_specplug/scorers/*"
      tests="test_scorers.py test_scorers_extra.py test_tree_runtime_unit.py test_bad_inputs.py" ;;
    budget) files="vllm_specplug/budget.py"
      tests="test_budget_unit.py test_batch_budget.py test_budget_cache.py test_eagle2_tree.py test_token_recycling.py" ;;
    tree) files="vllm_specplug/tree/*"
      tests="test_tree_structure.py test_tree_structure_edges.py test_token_recycling.py test_hybrid.py test_tree_runtime_unit.py" ;;
    global_store) files="vllm_specplug/proposers/global_store.py"
      tests="test_global_store.py test_global_store_sizes.py test_global_store_edges.py test_global_bytes.py" ;;
    sam) files="vllm_specplug/proposers/sam.py"
      tests="test_sam_proposer.py test_suffix_automaton.py test_corpus_automaton.py test_simulate.py test_global_store.py test_isolation.py test_faults.py test_bounds.py test_config.py test_hybrid.py test_global_bytes.py test_sam_edges.py test_stop_rule.py test_stop_rule_state.py" ;;
    drafter) files="vllm_specplug/vllm_adapter/v1/drafter.py"
      tests="test_drafter_unit.py test_drafter_paths.py test_batch_budget.py test_faults.py test_bounds.py test_budget_cache.py" ;;
    stop_rule) files="vllm_specplug/proposers/stop_rule.py"
      tests="test_stop_rule.py test_stop_rule_state.py test_sam_edges.py test_sam_proposer.py test_bounds.py test_config.py" ;;
    *) echo "unknown target '$target'; targets: scorers budget tree global_store sam stop_rule drafter" >&2; exit 2 ;;
  esac
  dir=$WORK/$target
  rm -rf "$dir" && mkdir -p "$dir"
  # the working tree as it is (edits and new files git does not ignore), without results/
  git ls-files --cached --others --exclude-standard | grep -v '^results/' \
    | while IFS= read -r f; do [[ -e $f ]] && printf '%s\n' "$f"; done \
    | tar -cf - -T - | tar -xf - -C "$dir"
  {
    echo "[mutmut]"
    echo "source_paths=vllm_specplug"
    echo "only_mutate=$files"
    echo "also_copy=examples"
    echo "use_git_change_detection=false"
    echo "pytest_add_cli_args=-p"
    echo "    no:cacheprovider"
    echo "    -m"
    echo "    not engine and not server and not slow"
    echo "pytest_add_cli_args_test_selection="
    for t in $tests; do echo "    tests/$t"; done
  } > "$dir/setup.cfg"
  # pyproject.toml must not hold [tool.mutmut], or setup.cfg is not read
  echo "== $target: mutating $files; tests: $tests"
  start=$(date +%s)
  (cd "$dir" && SPECPLUG_FAST_TESTS=1 VLLM_CPU_KVCACHE_SPACE=1 \
     "$PY" -m mutmut run --max-children "${MUTATION_CHILDREN:-2}") 2>&1 \
    | tr '\r' '\n' | grep -v '^[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏]' > "$OUT/$target.log" || true
  (cd "$dir" && "$PY" -m mutmut results --all true) > "$OUT/$target.txt" 2>&1 || true
  "$PY" - "$OUT/$target.txt" "$target" "$(( $(date +%s) - start ))" > "$OUT/$target.summary" <<'EOF'
import collections, sys
path, target, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3])
status = collections.Counter(line.rsplit(":", 1)[1].strip() for line in open(path)
                             if line.strip() and ":" in line)
total = sum(status.values())
killed = status.get("killed", 0) + status.get("timeout", 0) + status.get("segfault", 0)
print(f"{target}: {total} mutants, {dict(status)}; killed {killed}/{total} "
      f"({100 * killed / max(total, 1):.1f}%) in {seconds} s")
EOF
  cat "$OUT/$target.summary"
done

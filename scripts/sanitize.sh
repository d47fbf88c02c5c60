#!/usr/bin/env bash
# Runs the tests of the hand-written C extensions against a build of them with AddressSanitizer
# and UndefinedBehaviorSanitizer.
#
# The extensions setup.py lists (``native("...")``: kvcache._v1hash, events.wire._wire,
# router_sim.router._match, ...) are built at -O1 with -fsanitize=address,undefined in a copy of the
# working tree (its tracked and not-ignored files; the simulator's mypyc group is not compiled
# there), then the tests that call them run in that copy, with the sanitizers' runtime preloaded
# into the (unsanitized) interpreter and Python's own allocator off (PYTHONMALLOC=malloc), so an
# overrun of an object a C function allocated through Python is seen too. Any report (an
# out-of-bounds access, a use after free, an undefined shift or overflow) stops the process that
# made it and fails this script; so does a missing or unsanitized extension, or an import that
# took a module from anywhere but the copy.
#
#   scripts/sanitize.sh                   the native tests (a few minutes on 2 cores)
#   scripts/sanitize.sh tests/test_x.py   those tests instead (pytest arguments)
#
# Needs gcc with its libasan and libubsan (and the headers an extension includes).
# Leak checking is off: CPython keeps objects alive to its exit by design.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
CC="${CC:-gcc}"

fail() {
    echo "sanitize: FAILED: $*" >&2
    exit 1
}

command -v "$CC" >/dev/null || fail "no C compiler ($CC)"
ASAN_LIB="$("$CC" -print-file-name=libasan.so)"
UBSAN_LIB="$("$CC" -print-file-name=libubsan.so)"
# -print-file-name echoes the bare name back when it finds no such file
[[ "$ASAN_LIB" == /* && -e "$ASAN_LIB" ]] || fail "$CC has no libasan.so"
[[ "$UBSAN_LIB" == /* && -e "$UBSAN_LIB" ]] || fail "$CC has no libubsan.so"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/sanitize.XXXXXX")"
if [[ -z "${SANITIZE_KEEP:-}" ]]; then
    trap 'rm -rf "$WORK"' EXIT
else
    echo "sanitize: keeping $WORK"
fi
TREE="$WORK/tree"
LOGS="$WORK/logs"
mkdir -p "$TREE" "$LOGS"

# the working tree as it is (edits not committed yet included), without built files
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard) |
    (cd "$ROOT" && xargs -0 -I{} sh -c '[ -e "$1" ] && printf "%s\0" "$1"' _ {}) |
    (cd "$ROOT" && tar --null -T - -cf -) | (cd "$TREE" && tar -xf -)
[[ -f "$TREE/setup.py" ]] || fail "the copy of the tree has no setup.py"
if find "$TREE" -name '*.so' | grep -q .; then
    fail "the copy holds built extensions"
fi

# setup.py builds each extension at -O3 (its extra_compile_args come after CFLAGS, so they
# win): the copy builds them at -O1 instead, where a report's line numbers hold
n_opt="$(grep -c 'extra_compile_args=\["-O3"\]' "$TREE/setup.py" || true)"
[[ "$n_opt" == 1 ]] || fail "setup.py no longer sets extra_compile_args=[\"-O3\"] once; update this script"
sed -i 's/extra_compile_args=\["-O3"\]/extra_compile_args=["-O1"]/' "$TREE/setup.py"

SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
echo "sanitize: building the extensions in $TREE"
start=$SECONDS
(
    cd "$TREE"
    # SCOPED_KV_PURE: no mypyc group (the tests then run on the simulator's Python source)
    SCOPED_KV_PURE=1 CC="$CC" CFLAGS="$SAN -O1" LDFLAGS="$SAN" \
        "$PYTHON" setup.py build_ext --inplace
) >"$WORK/build.log" 2>&1 || {
    tail -n 40 "$WORK/build.log" >&2
    fail "build"
}

# every extension setup.py lists must be there, instrumented
mapfile -t MODULES < <(sed -nE 's/^[[:space:]]*native\("([A-Za-z0-9_.]+)".*/\1/p' "$TREE/setup.py")
((${#MODULES[@]} > 0)) || fail "found no native(\"...\") extension in setup.py; update this script"
for mod in "${MODULES[@]}"; do
    base="$TREE/${mod//.//}"
    so=("$base".*.so)
    # setup.py fails on an extension that does not compile; this checks it is in the copy
    [[ -f "${so[0]}" ]] || {
        grep -i -E 'warning|error' "$WORK/build.log" | tail -n 20 >&2
        fail "$mod was not built"
    }
    # instrumented: it calls the sanitizers' runtime
    nm -D --undefined-only "${so[0]}" | grep -q '__asan_report' ||
        fail "${so[0]} is not built with AddressSanitizer"
    nm -D --undefined-only "${so[0]}" | grep -q '__ubsan_handle' ||
        fail "${so[0]} is not built with UndefinedBehaviorSanitizer"
done
echo "sanitize: built in $((SECONDS - start)) s"

# the tests that call the extensions, directly or through the module that stands in front of
# it (those of an extension setup.py no longer lists are left out below)
TESTS=(
    tests/test_native_parity.py
    tests/test_wire_native_batch.py
    tests/test_packed_tokens.py
    tests/test_codec_fuzz.py
    tests/test_codec_wire.py
    tests/test_golden_vectors.py
    tests/test_hashing.py
    tests/test_chain_keys.py
    tests/test_records.py
    tests/test_event_manager_fastpath.py
    tests/test_event_manager_chain.py
    tests/test_indexer_native.py
    tests/test_indexer.py
    tests/test_index_flood.py
    tests/test_router_fastpath_wire.py
    tests/test_router_fastpath_overlap.py
    tests/test_workloads_native.py
    tests/test_prefetch.py
)
if [[ " ${MODULES[*]} " != *" router_sim.sim._prefetch "* ]]; then
    TESTS=("${TESTS[@]/tests\/test_prefetch.py/}")
fi
for i in "${!TESTS[@]}"; do
    [[ -n "${TESTS[$i]}" && -f "$TREE/${TESTS[$i]}" ]] || unset 'TESTS[i]'
done
# ASan reserves terabytes of address space for its shadow memory, which this test's child
# process cannot have (it caps its address space at 2 GiB to catch a runaway allocation)
TESTS+=(--deselect tests/test_codec_fuzz.py::test_huge_limits_are_refused_or_harmless)
if [[ $# -gt 0 ]]; then
    TESTS=("$@")
fi

export PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONMALLOC=malloc
# Every report stops the process that made it and leaves a file under $LOGS (a child process's
# too, whatever its parent does with its output). UBSan's own text goes to stderr only: with
# ASan's runtime loaded first, the report path UBSan sets is ASan's, not its own. So UBSan
# aborts, and ASan (handle_abort) writes that abort, with the stack through the
# __ubsan_handle_* function that caught it, to the file.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:handle_abort=1:log_path=$LOGS/asan"
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1:log_path=$LOGS/ubsan"
export LD_PRELOAD="$ASAN_LIB${LD_PRELOAD:+:$LD_PRELOAD}"
# hypothesis keeps its example database in the copy, which goes at the end
export HYPOTHESIS_STORAGE_DIRECTORY="$WORK/hypothesis"

cd "$TREE"
# the modules the tests import are the copy's sanitized builds, and their callers the copy's
"$PYTHON" - "$TREE" "${MODULES[@]}" <<'EOF' || fail "imports are not the sanitized copy"
import importlib
import sys
from pathlib import Path

tree = Path(sys.argv[1]).resolve()
extensions = sys.argv[2:]
# what stands in front of each extension, and for a caller that can still fall back at import,
# the name that says it took the extension (a fallback would leave the tests running nothing
# native); the others import it plainly, so their import fails without it
CALLERS = {
    "kvcache._v1hash": [("kvcache.hashing", None)],
    "events.wire._wire": [("events.wire.fast", None), ("events.wire.codec", None)],
    "router_sim.router._match": [("router_sim.router.indexer", "MaskTable")],
    "router_sim.sim._prefetch": [("router_sim.sim.prefetch", None)],
}
bad = [f"{name}: no caller known to this script; add it to CALLERS" for name in extensions if name not in CALLERS]
checks = [(name, None) for name in extensions]
checks += [(caller, flag) for name in extensions for caller, flag in CALLERS.get(name, [])]
for name, flag in checks:
    module = importlib.import_module(name)
    where = Path(module.__file__).resolve()
    inside = tree in where.parents
    print(f"sanitize: {name} <- {where.relative_to(tree) if inside else where}")
    if not inside:
        bad.append(f"{name} from {where}")
    if flag is not None and not getattr(module, flag, None):
        bad.append(f"{name}.{flag} is {getattr(module, flag, None)!r}")
if bad:
    print("\n".join(bad), file=sys.stderr)
    sys.exit(1)
EOF

echo "sanitize: running pytest ${TESTS[*]} under ASan+UBSan"
start=$SECONDS
set +e
"$PYTHON" -m pytest -q -p no:cacheprovider --timeout=900 "${TESTS[@]}"
rc=$?
set -e
echo "sanitize: tests took $((SECONDS - start)) s (pytest exit $rc)"

reports=("$LOGS"/*)
if [[ -e "${reports[0]}" ]]; then
    for r in "${reports[@]}"; do
        echo "---- $r" >&2
        if grep -q '__ubsan_handle_' "$r"; then
            echo "(UndefinedBehaviorSanitizer: the runtime error is in the stderr above;" \
                "the frame under __ubsan_handle_* is where)" >&2
        fi
        head -n 60 "$r" >&2
    done
    fail "${#reports[@]} sanitizer report(s)"
fi
# 134: a sanitizer aborted a process whose report did not reach a file
[[ $rc -eq 0 ]] || fail "pytest exit $rc"
echo "sanitize: ok (no sanitizer report)"

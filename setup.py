"""Builds the native extensions, of two kinds.

- The hand-written C extensions (one C file each) are required: the package has no other
  implementation of what they do, so a failed compile fails the build, naming the extension.
  They need a C compiler (gcc) and the Python development headers; ``router_sim.sim._prefetch``
  also OpenSSL's libcrypto and its headers.
- The simulator's hot pure-Python modules compiled with mypyc (:data:`COMPILED`) are optional.
  A compiled module shadows its ``.py`` file when both are there; the source stays the
  reference and runs wherever the compile is skipped (``SCOPED_KV_PURE=1`` in the environment
  at install time) or fails, and under ``scripts/pure_python.py``.
"""

import hashlib
import json
import os
import runpy
from collections.abc import Collection
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError

# The simulator's hot modules, compiled by mypyc as one group (calls between them are native);
# the list lives in router_sim/build_info.py, which reports at run time what is compiled.
HERE = Path(__file__).resolve().parent
MANIFEST = "_compiled_sources.json"
COMPILED = [
    name.replace(".", "/") + ".py"
    for name in runpy.run_path(str(HERE / "router_sim" / "build_info.py"))["COMPILED"]
]


class NativeBuildError(BaseError):
    """A required C extension did not build (setup reports it as ``error: ...`` and fails)."""


def _required_error(name: str, exc: BaseException) -> NativeBuildError:
    return NativeBuildError(
        f"the C extension {name} could not be built ({str(exc).rstrip('.')}). The C extensions "
        "are required: install gcc and the Python development headers (Python.h: the "
        "python3-dev or python3-devel package; router_sim.sim._prefetch also needs OpenSSL's "
        "libcrypto headers, libssl-dev or openssl-devel), then build again"
    )


class NativeBuildExt(build_ext):
    """The C extensions must build; the mypyc group may fail.

    A C extension that fails to compile fails the build (:class:`NativeBuildError`). The mypyc
    group is all or nothing: its modules load the group's shared library, so when any of them
    fails, the whole group is dropped and all of them run as Python.
    """

    c_built = False

    def finalize_options(self) -> None:
        # made here, not at import: only a build compiles (metadata steps also run this file)
        if not MYPYC:
            MYPYC.extend(_mypyc_extensions())
        self.distribution.ext_modules = [*(self.distribution.ext_modules or []), *MYPYC]
        super().finalize_options()

    def run(self) -> None:
        inplace = self.inplace  # setuptools builds in build_lib, then copies when in place
        try:
            super().run()
        except NativeBuildError:
            raise
        except Exception as exc:
            if not self.c_built:  # it failed before (or while) the C extensions were built
                names = ", ".join(e.name for e in self.extensions if not _is_mypyc(e))
                raise _required_error(names, exc) from exc
            print(f"warning: the mypyc group not built ({exc}); the simulator stays pure Python")
            self.extensions = [e for e in self.extensions if not _is_mypyc(e)]
        if not any(_is_mypyc(e) for e in self.extensions):
            if inplace:
                _remove_compiled_in_place()
            return
        if inplace:
            _remove_compiled_in_place(COMPILED)
        # what the group was compiled from, for router_sim.build_info.stale_modules
        out = HERE if inplace else Path(self.build_lib)
        sources = {
            path: hashlib.sha256((HERE / path).read_bytes()).hexdigest() for path in COMPILED
        }
        (out / "router_sim" / MANIFEST).write_text(json.dumps(sources, indent=1) + "\n")

    def build_extensions(self) -> None:
        for ext in [e for e in self.extensions if not _is_mypyc(e)]:
            try:
                self.build_extension(ext)
            except Exception as exc:
                raise _required_error(ext.name, exc) from exc
        self.c_built = True
        failed: list[Extension] = []
        for ext in [e for e in self.extensions if _is_mypyc(e)]:
            try:
                self.build_extension(ext)
            except Exception as exc:
                print(f"warning: {ext.name} not built ({exc}); the group runs as pure Python")
                failed.extend(MYPYC)
                break
        self.extensions = [e for e in self.extensions if e not in failed]


def _is_mypyc(ext: Extension) -> bool:
    return ext in MYPYC


def _remove_compiled_in_place(built_now: Collection[str] = ()) -> None:
    """Delete the compiled twin an earlier in-place build left beside a module this build does
    not compile (``built_now``: the sources it compiled): an import would take it first and
    run old code, or load a group that no longer holds it. A compiled module is one with a
    ``.py`` twin; the hand-written extensions have none and stay. With nothing compiled now,
    the group's library and its manifest go too."""
    kept = {HERE / path for path in built_now}
    for package in ("kvcache", "events", "router_sim"):
        for built in (HERE / package).rglob("*.so"):
            source = built.parent / (built.name.split(".", 1)[0] + ".py")
            if source.exists() and source not in kept:
                print(f"removing {built.relative_to(HERE)} (compiled by an earlier build)")
                built.unlink()
    # the group's library lives at the bottom package (kvcache), so that loading a compiled
    # kvcache module loads nothing of the packages above; earlier builds put it in router_sim
    for built in (HERE / "router_sim").glob("_compiled__mypyc.*.so"):
        built.unlink()
    if built_now:
        return
    for built in (HERE / "kvcache").glob("_compiled__mypyc.*.so"):
        built.unlink()
    (HERE / "router_sim" / MANIFEST).unlink(missing_ok=True)


def _mypyc_extensions() -> list[Extension]:
    """The :data:`COMPILED` group, or nothing (``SCOPED_KV_PURE=1``, or no mypyc here)."""
    if os.environ.get("SCOPED_KV_PURE", "") not in ("", "0"):
        print("SCOPED_KV_PURE is set: the simulator's modules stay pure Python")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("warning: mypyc is not installed; the simulator's modules stay pure Python")
        return []
    try:
        # The project's own mypy settings are for its linting (strict, with the stubs of the
        # dev extra); the compile needs only the annotations: an install builds in an
        # environment without the runtime dependencies, whose types are then unknown (Any),
        # and the modules it does not compile are read for their types only (their errors
        # there, such as msgspec's class options on an unknown base, are not the compile's).
        return list(
            mypycify(
                [
                    "--config-file=",
                    "--ignore-missing-imports",
                    "--follow-imports=silent",
                    *COMPILED,
                ],
                opt_level="3",
                group_name="kvcache._compiled",
            )
        )
    except (Exception, SystemExit) as exc:  # mypy reports a type error by exiting
        print(f"warning: mypyc could not compile ({exc}); the simulator stays pure Python")
        return []


MYPYC: list[Extension] = []


# the V1 hash's arithmetic (kvcache._v1hash includes it; a change to it rebuilds the extension)
V1CORE = "kvcache/_v1core.h"


def native(
    name: str,
    *,
    depends: tuple[str, ...] = (),
    libraries: tuple[str, ...] = (),
) -> Extension:
    """The required extension ``name`` built from its one C file at -O3; ``depends``: the
    headers it includes (a change to one rebuilds it); ``libraries``: what it links."""
    path = name.replace(".", "/") + ".c"
    return Extension(
        name,
        sources=[path],
        depends=list(depends),
        libraries=list(libraries),
        extra_compile_args=["-O3"],
    )


setup(
    ext_modules=[
        # kvcache.hashing's V1 block hashes (the router's, the event manager's, the records')
        native("kvcache._v1hash", depends=(V1CORE,)),
        # events.wire.codec / events.wire.fast's msgpack codec of the event path
        native("events.wire._wire"),
        # router_sim.router.indexer's match loop over a mirror of its masks, and the simulator's
        # trace prompts and answers
        native("router_sim.router._match"),
        # the simulator's prompts and their V1 hashes, made ahead on a native thread
        # (router_sim.sim.prefetch)
        native("router_sim.sim._prefetch", libraries=("crypto",)),
    ],
    cmdclass={"build_ext": NativeBuildExt},
)

"""Builds the optional native extensions; each has a pure-Python (or msgspec) fallback."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """A failed compile must not fail the install: events.hashing falls back to pure Python."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            print(f"warning: native extensions not built ({exc}); using pure Python")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"warning: {ext.name} not built ({exc}); using pure Python")


# the helpers the events package's three extensions share (a change to it rebuilds them)
COMMON = ["events/_native_common.h"]


def native(name: str, *, shared: bool = False) -> Extension:
    """The optional extension ``name`` built from its one C file at -O3; ``shared``: it
    includes :data:`COMMON`."""
    path = name.replace(".", "/") + ".c"
    depends = COMMON if shared else []
    return Extension(
        name, sources=[path], depends=depends, extra_compile_args=["-O3"], optional=True
    )


setup(
    ext_modules=[
        # events.hashing / events._records / events.codec's V1 hashes, records and runs
        # (pure-Python fallback)
        native("events._v1hash", shared=True),
        # events.codec / events.wire_fast's msgpack codec of the event path (pure-Python fallback)
        native("events._wire", shared=True),
        # router_sim.service.protocol's JSON prompt readers (msgspec fallback)
        native("events._json_prompt", shared=True),
        # router_sim.indexer's match loop over a mirror of its masks, and the simulator's trace
        # prompts and answers (pure-Python fallback)
        native("router_sim._match"),
        # kvcache.keys' pack-and-check of token arrays and SHA-256 chain keys where the CPU has
        # SHA-NI (pure-Python / hashlib fallback)
        native("kvcache._tokens"),
        # kvcache.tree's making of a run of blocks and linking of a committed chain
        # (pure-Python fallback)
        native("kvcache._tree"),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)

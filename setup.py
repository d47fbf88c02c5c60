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

setup(
    ext_modules=[
        # events.hashing / events._records / events.codec's V1 hashes, records and runs
        # (pure-Python fallback)
        Extension(
            "events._v1hash",
            sources=["events/_v1hash.c"],
            depends=COMMON,
            extra_compile_args=["-O3"],
            optional=True,
        ),
        # events.codec / events.wire_fast's msgpack codec of the event path (pure-Python fallback)
        Extension(
            "events._wire",
            sources=["events/_wire.c"],
            depends=COMMON,
            extra_compile_args=["-O3"],
            optional=True,
        ),
        # router_sim.service.protocol's JSON prompt readers (msgspec fallback)
        Extension(
            "events._json_prompt",
            sources=["events/_json_prompt.c"],
            depends=COMMON,
            extra_compile_args=["-O3"],
            optional=True,
        ),
        # router_sim.indexer's match loop over a mirror of its masks (pure-Python fallback)
        Extension(
            "router_sim._match",
            sources=["router_sim/_match.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        # kvcache.keys' pack-and-check of token arrays (pure-Python fallback)
        Extension(
            "kvcache._tokens",
            sources=["kvcache/_tokens.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)

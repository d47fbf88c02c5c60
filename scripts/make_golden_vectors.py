"""Write the golden hash vectors shipped in events/tools/golden/ (one file per algorithm).

The values do not come from the code they guard: this script re-implements WIRE.md sections
1-3 on its own (the V1 BlockKeyHasher from the pseudocode, block keys with hashlib, the salt id,
the xxh3 content hash with the xxhash package) and imports nothing from this project. Before
writing, it checks that implementation against every vector WIRE.md publishes (transcribed
below); where WIRE.md gives a case's value, that value is written as published.

Run from the repository root:  python scripts/make_golden_vectors.py [OUT_DIR]
The files must never change once shipped: an algorithm's output is a compatibility promise.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import xxhash

M64 = (1 << 64) - 1
M32 = (1 << 32) - 1
M1, M2, C32, G = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x45D9F3B, 0x9E3779B9


# ------------------------------------------------------------ WIRE.md 1-3, independently


def scope_bytes(lora: int | None, salt: int | None) -> bytes:
    mask = (1 if lora is not None else 0) | (2 if salt is not None else 0)
    body = b"".join(v.to_bytes(8, "little") for v in (lora, salt) if v is not None)
    return bytes([mask]) + body


def salt_of(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")


def keys(tokens: list[int], tpb: int, lora: int | None, salt: int | None) -> list[bytes]:
    """Block keys of the full blocks."""
    parent = hashlib.sha256(scope_bytes(lora, salt)).digest()
    out = []
    for i in range(0, len(tokens) - len(tokens) % tpb, tpb):
        body = b"".join(t.to_bytes(4, "little") for t in tokens[i : i + tpb])
        parent = hashlib.sha256(parent + body).digest()
        out.append(parent)
    return out


def mix32(a: int, seed: int) -> int:
    a &= M32
    a = (((a >> 16) ^ a) * C32) & M32
    a = (((a >> 16) ^ a) * C32) & M32
    a = (a >> 16) ^ a
    return seed ^ ((((a + G) & M32) + (seed << 6) + (seed >> 2)) & M64)


def mix64(b: int, seed: int) -> int:
    b = ((b ^ (b >> 30)) * M1) & M64
    b = ((b ^ (b >> 27)) * M2) & M64
    b = b ^ (b >> 31)
    return seed ^ ((b + G + (seed << 6) + (seed >> 2)) & M64)


def v1(tokens: list[int], parent: int, lora: int | None, salt: int | None) -> int:
    seed = len(tokens) ^ ((parent * M1) & M64)
    if parent == 0 and salt is not None:
        seed = mix64(salt, seed)
    for t in tokens:
        seed = mix32(t, seed)
    if lora is not None:
        seed = mix64(lora, seed)
    return seed


def v1_chain(tokens: list[int], tpb: int, lora: int | None, salt: int | None) -> list[int]:
    parent, out = 0, []
    for i in range(0, len(tokens) - len(tokens) % tpb, tpb):
        parent = v1(tokens[i : i + tpb], parent, lora, salt)
        out.append(parent)
    return out


def hashes(algo: str, tokens: list[int], tpb: int, lora: int | None, salt: int | None) -> list:
    if algo == "v1_block_key":
        return v1_chain(tokens, tpb, lora, salt)
    if algo == "v2_sha256":
        return [k.hex() for k in keys(tokens, tpb, lora, salt)]
    if algo == "v2_sha256_64":
        return [int.from_bytes(k[:8], "big") for k in keys(tokens, tpb, lora, salt)]
    assert algo == "xxh3_content"
    full = len(tokens) - len(tokens) % tpb
    return [
        xxhash.xxh3_64_intdigest(
            b"".join(t.to_bytes(4, "little") for t in tokens[i : i + tpb]), seed=1337
        )
        for i in range(0, full, tpb)
    ]


# ------------------------------------------------------------ WIRE.md's published vectors

WIRE_SCOPE_BYTES = {
    (None, None): "00",
    (0, None): "010000000000000000",
    (None, 0): "020000000000000000",
    (7, 11): "0307000000000000000b00000000000000",
}
WIRE_SALT = {"tenant-a": 16248643848220682112}
WIRE_KEYS = {  # (tokens, tpb 4, lora, salt) -> keys of the blocks, partial last included
    "root": "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "root_7_11": "9e22dbfea623bd030eb7ae4a0d71a7a6beb3cbf25797bcc31ddd0acc5513d3a3",
    "0..7": [
        "7b894451a88bc03088bd0c44f01139922b089a1ab691d157c273185c78ca83b2",
        "181684b4f09a9fc1689624a565bc5c9ed96cede3e0863cf373463b1a93c45369",
    ],
    "0..3_7_11": ["9b0fd0e09150ccecc056c02607ac5a1102556d12560862529f46bd5fe9d443bb"],
}
WIRE_V1_BLOCKS = [  # tokens, parent, lora, salt, hash
    ([1, 2, 3, 4], 0, None, None, 924206229973855),
    ([5, 6], 924206229973855, None, None, 6875034662206558884),
    ([1, 2, 3, 4], 0, None, 123, 6280297290684427985),
    ([5, 6], 6280297290684427985, None, 123, 18177682803760873588),
    ([1, 2, 3, 4], 0, 123, None, 15718075209399076427),
]
WIRE_V1_CHAINS = {
    (None, None): [733356887393045, 6310903394565074474],
    (7, 11): [11481563305523318472, 9304211693877664517],
}
WIRE_XXH3_1234 = 14643705804678351452


def check_against_wire() -> None:
    for (lora, salt), hexed in WIRE_SCOPE_BYTES.items():
        assert scope_bytes(lora, salt).hex() == hexed
    for text, salt in WIRE_SALT.items():
        assert salt_of(text) == salt
    assert hashlib.sha256(scope_bytes(None, None)).hexdigest() == WIRE_KEYS["root"]
    assert hashlib.sha256(scope_bytes(7, 11)).hexdigest() == WIRE_KEYS["root_7_11"]
    assert [k.hex() for k in keys(list(range(8)), 4, None, None)] == WIRE_KEYS["0..7"]
    assert [k.hex() for k in keys([0, 1, 2, 3], 4, 7, 11)] == WIRE_KEYS["0..3_7_11"]
    for tokens, parent, lora, salt, want in WIRE_V1_BLOCKS:
        assert v1(tokens, parent, lora, salt) == want, (tokens, parent, lora, salt)
    for (lora, salt), want in WIRE_V1_CHAINS.items():
        assert v1_chain(list(range(8)), 4, lora, salt) == want
    assert hashes("xxh3_content", [1, 2, 3, 4], 4, None, None) == [WIRE_XXH3_1234]


# ------------------------------------------------------------------------- the corpus

FROM_WIRE = "WIRE.md section 3 (published value)"
FROM_WIRE_KEYS = "WIRE.md section 2 block keys (published value)"
INDEPENDENT = "scripts/make_golden_vectors.py (independent WIRE.md implementation)"

CASES: list[dict] = [
    {
        "name": "wire-0..7",
        "tokens_per_block": 4,
        "lora_id": None,
        "salt_id": None,
        "tokens": list(range(8)),
    },
    {
        "name": "wire-0..7-lora7-salt11",
        "tokens_per_block": 4,
        "lora_id": 7,
        "salt_id": 11,
        "tokens": list(range(8)),
    },
    {
        "name": "wire-1..4",
        "tokens_per_block": 4,
        "lora_id": None,
        "salt_id": None,
        "tokens": [1, 2, 3, 4],
    },
    {
        "name": "wire-1..4-salt123",
        "tokens_per_block": 4,
        "lora_id": None,
        "salt_id": 123,
        "tokens": [1, 2, 3, 4],
    },
    {
        "name": "wire-1..4-lora123",
        "tokens_per_block": 4,
        "lora_id": 123,
        "salt_id": None,
        "tokens": [1, 2, 3, 4],
    },
    {
        "name": "tenant-a-lora3-16",
        "tokens_per_block": 16,
        "lora_id": 3,
        "cache_salt": "tenant-a",
        "tokens": [(7919 * i) % 151_000 for i in range(70)],
    },
    {
        "name": "lora0-is-not-no-lora",
        "tokens_per_block": 16,
        "lora_id": 0,
        "salt_id": None,
        "tokens": list(range(100, 132)),
    },
    {
        "name": "salt0-is-not-no-salt",
        "tokens_per_block": 16,
        "lora_id": None,
        "salt_id": 0,
        "tokens": list(range(100, 132)),
    },
    {
        "name": "max-token-ids",
        "tokens_per_block": 4,
        "lora_id": (1 << 64) - 1,
        "salt_id": (1 << 64) - 1,
        "tokens": [2**31 - 1, 2**31 - 2, 0, 65535, 65536, 2**31 - 1, 1, 0x9E3779B9 & 0x7FFFFFFF],
    },
    {
        "name": "one-token-blocks",
        "tokens_per_block": 1,
        "lora_id": None,
        "salt_id": None,
        "tokens": [5, 6, 7],
    },
]


def published(algo: str, case: dict) -> tuple[list, str]:
    """The case's hashes and where they come from; WIRE.md's value wherever it has one."""
    tokens, tpb = case["tokens"], case["tokens_per_block"]
    lora = case["lora_id"]
    salt = salt_of(case["cache_salt"]) if "cache_salt" in case else case["salt_id"]
    mine = hashes(algo, tokens, tpb, lora, salt)
    name = case["name"]
    wire: list | None = None
    source = FROM_WIRE
    if algo == "v1_block_key" and name == "wire-0..7":
        wire = WIRE_V1_CHAINS[(None, None)]
    elif algo == "v1_block_key" and name == "wire-0..7-lora7-salt11":
        wire = WIRE_V1_CHAINS[(7, 11)]
    elif algo == "v1_block_key" and name.startswith("wire-1..4"):
        wire = [
            next(
                h
                for t, p, lo, sa, h in WIRE_V1_BLOCKS
                if t == tokens and p == 0 and lo == lora and sa == salt
            )
        ]
    elif algo.startswith("v2_") and name == "wire-0..7":
        wire, source = WIRE_KEYS["0..7"], FROM_WIRE_KEYS
    elif algo == "xxh3_content" and name == "wire-1..4":
        wire = [WIRE_XXH3_1234]
    if wire is None:
        return mine, INDEPENDENT
    if algo == "v2_sha256_64":
        wire = [int(k[:16], 16) for k in wire]
    assert mine == wire, (algo, name)
    return wire, source


def write(out_dir: Path) -> None:
    algos = ["v1_block_key", "v2_sha256", "v2_sha256_64", "xxh3_content"]
    notes = {
        "v1_block_key": "TensorRT-LLM's V1 BlockKeyHasher, 64-bit, chained (WIRE.md 3)",
        "v2_sha256": "the 32-byte block key as 64 lowercase hex characters (WIRE.md 2-3)",
        "v2_sha256_64": "the first 8 bytes of the block key, big-endian (WIRE.md 3)",
        "xxh3_content": "xxh3_64 of a block's tokens as 4-byte LE, seed 1337; not chained, "
        "scope-blind (WIRE.md 3, router-side content hash)",
    }
    for algo in algos:
        lines = [
            "{",
            '  "format": "kv-events-golden",',
            '  "version": 1,',
            f'  "algorithm": {json.dumps(algo)},',
            f'  "definition": {json.dumps(notes[algo])},',
            '  "since": "0.1.0",',
            '  "promise": "These values never change; a changed output is a new algorithm name.",',
            '  "tokens_per_block": 4,',
            f'  "algorithms": [{json.dumps(algo)}],',
            '  "cases": [',
        ]
        for n, case in enumerate(CASES):
            values, source = published(algo, case)
            fields = dict(case)
            fields["source"] = source
            body = [f"      {json.dumps(k)}: {json.dumps(v)}" for k, v in fields.items()]
            body.append(f'      "hashes": {{{json.dumps(algo)}: {json.dumps(values)}}}')
            end = "," if n + 1 < len(CASES) else ""
            lines.append("    {\n" + ",\n".join(body) + "\n    }" + end)
        lines += ["  ]", "}"]
        (out_dir / f"{algo}.json").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    check_against_wire()
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("events/tools/golden")
    target.mkdir(parents=True, exist_ok=True)
    write(target)
    print(f"checked against every WIRE.md vector; wrote {target}/*.json")

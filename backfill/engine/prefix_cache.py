"""Content addresses of full KV blocks, for automatic prefix caching (as vLLM v1's block hashes).

A block's address chains its parent's address, its token ids and an extra key (the LoRA adapter:
an adapter changes every K and V it touches), so two blocks share an address only when every
token before and in them, and everything that changes their values, is the same. The root of the
chain names the model, dtype and block size (KVBlockPool.hash_root), so addresses never cross pools.
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes

# 128-bit BLAKE2b: a collision between two prefixes is out of reach (the builtin hash is 64-bit
# and seeded per process, so it is neither safe against crafted prompts nor stable).
HASH_BYTES = 16


def root_hash(*parts: str) -> BlockHash:
    """The chain's root for a pool: every part that changes a KV value but not the token ids."""
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=HASH_BYTES).digest()


def block_hash(parent: BlockHash, token_ids: list[int], extra_key: str = "") -> BlockHash:
    """The address of one full block: its parent's address, its tokens, its extra key."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(array("q", token_ids).tobytes())
    if extra_key:
        h.update(b"\x00" + extra_key.encode())
    return h.digest()


def extend_hashes(hashes: list[BlockHash], root: BlockHash, token_ids: list[int], block_size: int,
                  num_blocks: int, extra_key: str = "") -> None:
    """Append to hashes (the chain of token_ids' first blocks) until it covers num_blocks full blocks."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} full blocks of {block_size} need {num_blocks * block_size} tokens, "
                         f"got {len(token_ids)}")
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else root
        hashes.append(block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], extra_key))

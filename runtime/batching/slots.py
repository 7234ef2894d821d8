"""Which cache slot holds which tokens: the batched engine's bookkeeping for slot reuse.

A slot keeps the ids whose K/V rows it holds after its sequence leaves, so a later request (the next turn
of a chat, a shared system prompt) that starts with them is given that slot and prefills only the rest,
as the one-sequence Session reuses its cache.
"""

from __future__ import annotations


class SlotTable:
    """`slots` cache slots, each free or held by one sequence, each remembering its cached ids."""

    def __init__(self, slots: int):
        self.cached: list[list[int]] = [[] for _ in range(slots)]
        self.free: list[int] = list(range(slots))

    def take(self, prompt: list[int], reuse: bool = True) -> tuple[int, int]:
        """Hold the free slot whose cached ids share the longest prefix with `prompt` (at most all but its
        last token, whose logits give the first new token; ties: the least recently freed). Returns (slot,
        prompt rows already cached there). Raises IndexError when no slot is free."""
        if not self.free:
            raise IndexError("no free slot")
        best, best_len = self.free[0], -1
        for slot in self.free:
            n = common_prefix(self.cached[slot], prompt) if reuse else 0
            if n > best_len:
                best, best_len = slot, n
        self.free.remove(best)
        del self.cached[best][best_len:]
        return best, best_len

    def release(self, slot: int, cached: list[int]) -> None:
        """Free `slot`, whose rows now hold the K/V of `cached`."""
        self.cached[slot] = list(cached)
        self.free.append(slot)


def common_prefix(cached: list[int], prompt: list[int]) -> int:
    """Length of the common prefix of `cached` and `prompt`, leaving at least prompt's last token."""
    n, limit = 0, max(min(len(cached), len(prompt) - 1), 0)
    while n < limit and cached[n] == prompt[n]:
        n += 1
    return n

"""The prompts of ``specdec bench`` (:mod:`benchmarks.inprocess`): code, SQL/JSON, a copy-heavy
rewrite (cut at ``--tokens``, and ``code-rename-full`` run to the end of the rewritten block: its
own ``max_tokens``, type ``copy_full``) and open creative writing, each one user message rendered with the target's chat
template; choosing them by name or type."""

from __future__ import annotations

from benchmarks.report import PROMPT_TYPES

#: The code block the copy-heavy prompt asks to rewrite with one rename.
RENAME_SOURCE = """from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def total_price(items: list[Item], discount: float = 0.0) -> float:
    \"\"\"Sum of price times quantity over the items, less a fractional discount.\"\"\"
    if not 0.0 <= discount < 1.0:
        raise ValueError(f"discount must be in [0, 1), got {discount}")
    subtotal = sum(item.price * item.quantity for item in items)
    return round(subtotal * (1.0 - discount), 2)


def print_receipt(items: list[Item]) -> None:
    for item in items:
        print(f"{item.name:20s} {item.quantity:3d} x {item.price:8.2f}")
    print(f"{'total':20s} {total_price(items):16.2f}")
"""

#: The prompts: name, type, one user message (rendered with the target's chat template);
#: optional ``max_tokens`` (the prompt's own cap on new tokens instead of ``--tokens``) and
#: ``tenant`` (an adaptive method's tenant; default the type).
PROMPTS: list[dict] = [
    {
        "name": "code-prime",
        "type": "code",
        "content": "Write a Python function `is_prime(n: int) -> bool` that returns True when n is a prime "
        "number. Include a docstring and handle n < 2.",
    },
    {
        "name": "code-merge",
        "type": "code",
        "content": "Write a Python function `merge_sorted(a: list[int], b: list[int]) -> list[int]` that merges "
        "two sorted lists into one sorted list in linear time. Include type hints and a docstring.",
    },
    {
        "name": "json-book",
        "type": "sql_json",
        "content": "Return only a JSON object describing a book, with the fields title, author, year, isbn, "
        "genres (a list of strings), publisher (an object with name and city) and ratings (an object "
        "with average and count).",
    },
    {
        "name": "sql-top-customers",
        "type": "sql_json",
        "content": "Write an SQL query that returns the ten customers with the highest total order value in "
        "2023, given the tables customers(id, name, country) and orders(id, customer_id, total, "
        "created_at). Show the customer name, country and total.",
    },
    {
        # copy-heavy: the answer repeats the prompt's code with one identifier renamed, the case
        # prompt lookup (n-gram drafting) is made for
        "name": "code-rename",
        "type": "copy",
        "content": "Rewrite this Python code with the function `total_price` renamed to `order_total` "
        "everywhere. Return only the code.\n\n```python\n" + RENAME_SOURCE + "```",
    },
    {
        # the same rewrite run to its natural end: the whole rewritten block (EOS), not its first
        # --tokens tokens; its own type, so its ratios are not mixed with the 32-token figure
        "name": "code-rename-full",
        "type": "copy_full",
        "tenant": "copy",
        "max_tokens": 256,
        "content": "Rewrite this Python code with the function `total_price` renamed to `order_total` "
        "everywhere. Return only the code.\n\n```python\n" + RENAME_SOURCE + "```",
    },
    {
        "name": "poem-sea",
        "type": "creative",
        "content": "Write a short poem about the sea at night, with vivid images of the moon, the waves and a "
        "lonely lighthouse.",
    },
]


def select_prompts(names: list[str] | None) -> list[dict]:
    """The prompts named (by name or type), in the order given; all prompts when ``names`` is empty."""
    if not names:
        return [dict(p) for p in PROMPTS]
    unknown = [n for n in names if n not in {p["name"] for p in PROMPTS} | set(PROMPT_TYPES)]
    if unknown:
        raise ValueError(f"unknown prompt(s) {unknown}; known: {[p['name'] for p in PROMPTS]} or types {PROMPT_TYPES}")
    chosen: list[dict] = []
    for n in names:
        for p in PROMPTS:
            if n in (p["name"], p["type"]) and all(c["name"] != p["name"] for c in chosen):
                chosen.append(dict(p))
    return chosen


def chat_request(p: dict):
    from specdec.request import GenerationRequest

    return GenerationRequest(messages=[{"role": "user", "content": p["content"]}], max_tokens=1)

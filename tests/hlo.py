"""Reading compiled HLO text in tests: split into computations, count collective ops."""

import re


def computations(hlo: str) -> dict[str, str]:
    """HLO text split into computations by name."""
    out, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            name = m.group(1)
            out[name] = ""
        elif name:
            out[name] += line + "\n"
    return out


def count(text: str, op: str) -> int:
    """Occurrences of an HLO op (sync or async-start form)."""
    return len(re.findall(rf"\b{op}(?:-start)?\(", text))


def loop_bodies(hlo: str) -> list[str]:
    """The body computations of every while loop (a lax.scan compiles to one)."""
    comps = computations(hlo)
    return [comps[b] for b in re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo)]

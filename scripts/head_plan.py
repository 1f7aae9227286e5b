"""Print the head plan tables for (num_heads, num_kv_heads) at several tp sizes, as markdown.

    python scripts/head_plan.py 9 3 --tp 1 2 3 4 8      # the tables in docs/head_plan.md
"""

import argparse

from tp_jax.parallel.heads import plan_tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("num_heads", type=int)
    ap.add_argument("num_kv_heads", type=int)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    args = ap.parse_args()
    print(plan_tables(args.num_heads, args.num_kv_heads, tuple(args.tp)), end="")


if __name__ == "__main__":
    main()

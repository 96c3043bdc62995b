"""Write the student stubs of the graded exercises into ``chapters/exercises/``.

The stubs are rendered by ``chapters/exercise_stubs.py`` from the exercise
markers of the reference code. A stub that holds a student's answer is kept
unless ``--force`` is given; to start one exercise over, use
``python -m chapters.grade 4.1 --reset`` instead.

    python scripts/make_exercises.py          # (re)write every untouched stub, delete stale ones
    python scripts/make_exercises.py --check  # CI: exit 1 if any stub is missing or out of date
"""

from __future__ import annotations

import argparse
import sys

from chapters.exercise_stubs import check, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only verify; exit 1 when a stub is stale")
    parser.add_argument("--force", action="store_true", help="also overwrite stubs that hold a student's answer")
    args = parser.parse_args(argv)
    if not args.check:
        write(force=args.force)
        return 0
    problems = check()
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print("Run: python scripts/make_exercises.py", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""A three-problem excerpt of CHAMP's v0.json (champ-dataset 1.0.0 on PyPI, MIT) in its own layout,
for data/tests/it/trajectories.rs: k3mini reads the real file the same way.

    pip download champ-dataset==1.0.0 --no-deps -d /tmp/champ && unzip -o /tmp/champ/*.whl -d /tmp/champ
    python scripts/golden/champ_fixture.py /tmp/champ/champ_dataset/dataset_files/v0.json
"""
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "data" / "tests" / "fixtures" / "champ-excerpt.json"
# Problem 10 sorts before 2 as text: the reader must order by number.
KEEP = ["P_Combinatorics_2", "P_Combinatorics_10", "P_Inequality_1"]


def main() -> None:
    full = json.loads(Path(sys.argv[1]).read_text())
    problems = {}
    for key in KEEP:
        p = full["problems"][key]
        # Keep the fields k3mini reads plus a few it must skip; drop the bulky conversations.
        problems[key] = {k: p[k] for k in ["identifier", "_raw_text", "_text", "category", "_raw_answer", "_answer", "ch_list"]}
    OUT.write_text(json.dumps({"problems": problems, "concepts": {}, "hints": {}}, indent=1, ensure_ascii=False) + "\n")
    print(OUT)


if __name__ == "__main__":
    main()

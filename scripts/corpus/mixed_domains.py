"""Builds the mixed-domain corpus the MoE teacher recipe trains on and routes (recipes/moe-teacher.toml):
prose (the Shakespeare plays already in recipes/corpus/shakespeare), code and maths, each a
JSONL of {"text": ...} documents so a recipe names each domain as one source.

    python3 scripts/corpus/mixed_domains.py           # pip downloads champ-dataset 1.0.0 (MIT)

- code/python-stdlib.jsonl: ten pure-Python modules of the running interpreter's standard library
  (PSF License 2.0, recipes/corpus/code/LICENSE-PSF.txt), one document per module.
- code/python-stdlib-heldout.jsonl: five other modules, the code domain's evaluation set (no
  recipe trains on it; recipes/moe-heldout-code.toml holds it out whole).
- maths/champ.jsonl: CHAMP's 270 competition-maths problems (champ-dataset 1.0.0, MIT,
  recipes/corpus/maths/LICENSE-CHAMP.txt), each as "Problem: … Solution: <its steps> Answer: …".
"""
import hashlib
import json
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[2] / "recipes" / "corpus"
MODULES = ["bisect", "calendar", "colorsys", "difflib", "fractions", "functools", "graphlib",
           "heapq", "statistics", "textwrap"]
HELD_OUT_MODULES = ["copy", "numbers", "pprint", "shlex", "string"]
CHAMP_WHEEL = "champ_dataset-1.0.0-py3-none-any.whl"
CHAMP_SHA256 = "aa59df5ae28e2ec76a401a46faf3d6395920be8009a01ce451f7d5c131d82201"


def write_jsonl(path: Path, docs: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for text in docs:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    print(f"wrote {path} ({len(docs)} documents, {path.stat().st_size} bytes)")


def code() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name, modules in [("python-stdlib", MODULES), ("python-stdlib-heldout", HELD_OUT_MODULES)]:
        docs = [(stdlib / f"{m}.py").read_text(encoding="utf-8") for m in modules]
        write_jsonl(CORPUS / "code" / f"{name}.jsonl", docs)
    (CORPUS / "code" / "LICENSE-PSF.txt").write_text((stdlib / "LICENSE.txt").read_text())
    print(f"  from Python {sys.version.split()[0]}'s {stdlib}")


def maths() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                        "champ-dataset==1.0.0", "-d", tmp], check=True)
        wheel = Path(tmp) / CHAMP_WHEEL
        assert hashlib.sha256(wheel.read_bytes()).hexdigest() == CHAMP_SHA256, "not the pinned wheel"
        with zipfile.ZipFile(wheel) as z:
            data = json.loads(z.read("champ_dataset/dataset_files/v0.json"))
            license_text = z.read("champ_dataset-1.0.0.dist-info/LICENSE").decode()
    docs = []
    for pid, p in sorted(data["problems"].items()):
        steps = " ".join(s["_text"] for s in p["solution"]["steps"])
        docs.append(f"Problem: {p['_text']}\nSolution: {steps}\nAnswer: {p['_answer']}\n")
    write_jsonl(CORPUS / "maths" / "champ.jsonl", docs)
    (CORPUS / "maths" / "LICENSE-CHAMP.txt").write_text(license_text)


if __name__ == "__main__":
    code()
    maths()

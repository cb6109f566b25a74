"""An installed ccexp starts: the wheel carries its configs (recipes and sweeps included) and finds them
through ``pkg://ccexp.conf``, from any folder."""
from __future__ import annotations

import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_the_wheel_ships_its_configs_and_runs_from_another_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(ROOT)], check=True, capture_output=True, text=True)
    wheel = next(dist.glob("ccexp-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"ccexp/conf/config.yaml", "ccexp/conf/recipe/llama2_7b.yaml", "ccexp/conf/sweep/sampler_ablation.yaml",
            "ccexp/conf/sampler/clusterclip.yaml", "ccexp/data/builtin/debmix_mini.jsonl.gz",
            "ccexp/conf/hydra/launcher/slurm.yaml", "ccexp/conf/recipe/smollm2_135m.yaml"} <= names

    # a fresh venv holding only the wheel; the dependencies come from this interpreter's site-packages,
    # added as a plain path (so its editable install of ccexp is not seen)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, env=env)
    fresh_site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     check=True, capture_output=True, text=True, env=env).stdout.strip())
    (fresh_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def ccexp(*args: str) -> str:
        proc = subprocess.run([str(py), "-m", "ccexp", *args], cwd=elsewhere, capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    where = subprocess.run([str(py), "-c", "import ccexp; print(ccexp.__file__)"], cwd=elsewhere, check=False,
                           capture_output=True, text=True, env=env)
    assert where.returncode == 0, where.stderr
    where = where.stdout
    assert str(venv) in where  # the installed wheel, not the source tree
    assert "sampler:" in ccexp("--cfg", "job") and "name: clusterclip" in ccexp("--cfg", "job")
    recipe = ccexp("+recipe=llama2_7b", "sampler=uniform", "--cfg", "job")
    assert "pretrained: meta-llama/Llama-2-7b-hf" in recipe and "name: uniform" in recipe
    assert "sampler: random,uniform,clusterclip" in ccexp("+sweep=sampler_ablation", "--cfg", "hydra")

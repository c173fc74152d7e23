"""The site file: defaults < site < recipe < local profile < --set, seen in rendered scripts; a bad site file is one
line naming the file and the field; the manifest names the site file a run took its defaults from."""

from __future__ import annotations

import pytest
import yaml

from hpc_tools.errors import UserError
from hpc_tools.recipe.load import dump_resolved, load_recipe, resolve
from hpc_tools.recipe.site import site_path
from hpc_tools.recipe.yamlfile import parse_yaml
from tests.helpers import REPO, run_cli

COMM = "recipes/comm_check.yaml"
SITE = {"cluster": {"account": "proj42", "partition": "site-part", "qos": "site-qos", "gpu_type": "A100-80GB",
                    "sbatch_extra": ["--mail-type=END"],
                    "setup": {"modules": ["cuda/12.4"], "env": {"SITE_VAR": "from-site", "SHARED": "site"}}},
        "training": {"log_interval": 7, "train_iters": 99},
        "local": {"cluster": {"qos": "site-local-qos"}}}


@pytest.fixture
def site(tmp_path, monkeypatch):
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(SITE))
    monkeypatch.setenv("HPC_TOOLS_SITE", str(path))
    return path


def test_precedence_in_the_rendered_script(site, tmp_path):
    """comm_check sets partition (recipe beats site); --set beats both; the rest comes from the site file."""
    recipe = tmp_path / "r.yaml"
    raw = yaml.safe_load((REPO / COMM).read_text())
    raw["cluster"]["setup"] = {"env": {"SHARED": "recipe"}}
    recipe.write_text(yaml.safe_dump(raw))
    out = run_cli("render", str(recipe), "-o", "-", "--set", "cluster.qos=cli-qos",
                  env={"HPC_TOOLS_SITE": str(site)})
    assert out.returncode == 0, out.stderr
    assert f"site settings: {site}" in out.stderr
    script = out.stdout.splitlines()
    assert "#SBATCH --partition=gpu" in script  # the recipe's own value
    assert "#SBATCH --account=proj42" in script  # the site's default
    assert "#SBATCH --qos=cli-qos" in script and "#SBATCH --qos=site-qos" not in script  # --set wins
    assert "#SBATCH --mail-type=END" in script
    assert "module load cuda/12.4 || hpc_tools_setup_failed $? 'module load cuda/12.4'" in script
    assert "export SITE_VAR=from-site" in script and "export SHARED=recipe" in script  # mappings merge key by key
    assert "#SBATCH --gpus-per-node=8" in script  # gpu_type from the site: still a GPU job


def test_local_profile_and_set_sit_above_the_site(site):
    local = load_recipe(REPO / COMM, profile="local")
    assert local.cluster.qos == "site-local-qos" and local.cluster.account == "proj42"
    assert local.training.train_iters == 5 and local.training.log_interval == 7  # local profile > recipe > site
    assert load_recipe(REPO / COMM, ["cluster.qos=x"], profile="local").cluster.qos == "x"
    plain = load_recipe(REPO / COMM)
    assert plain.training.train_iters == 20 and plain.cluster.gpu_type == "H100-SXM"  # the recipe's own values
    assert plain.cluster.qos == "site-qos" and plain.training.log_interval == 7


@pytest.mark.parametrize("text, field", [
    ("cluster:\n  partiton: batch\n", "cluster.partiton=batch is not a known key (did you mean 'partition'?"),
    ("cluster:\n  nodes: -1\n", "cluster.nodes=-1"),
    ("cluster:\n  sbatch_extra: ['--time=5']\n", "--time, which hpc_tools sets itself"),
    ("name: mine\n", "name is not a section a site file may set"),
    ("cluster: 5\n", "cluster=5 must be a mapping"),
    ("cluster:\n  account: a\n  account: b\n", "duplicate key 'account'"),
    ("- a list\n", "must be a YAML mapping"),
])
def test_a_bad_site_file_is_one_line_naming_file_and_field(tmp_path, text, field):
    path = tmp_path / "site.yaml"
    path.write_text(text)
    out_file = tmp_path / "job.sbatch"
    out = run_cli("render", COMM, "-o", str(out_file), env={"HPC_TOOLS_SITE": str(path)})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"site file {path}" in lines[0] and field in lines[0], out.stderr
    assert not out_file.exists()


def test_which_site_file(tmp_path, monkeypatch):
    home = tmp_path / "home"
    assert site_path({"HOME": str(home)}) is None
    default = home / ".config" / "hpc_tools" / "site.yaml"
    default.parent.mkdir(parents=True)
    default.write_text("cluster: {account: a}\n")
    assert site_path({"HOME": str(home)}) == default
    assert site_path({"HOME": str(home), "HPC_TOOLS_SITE": "none"}) is None
    assert site_path({"HOME": str(home), "HPC_TOOLS_SITE": ""}) is None
    with pytest.raises(UserError, match="does not exist"):
        site_path({"HOME": str(home), "HPC_TOOLS_SITE": str(tmp_path / "missing.yaml")})
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("HPC_TOOLS_SITE")
    assert load_recipe(REPO / COMM).cluster.account == "a"


def test_manifest_names_the_site_file(site, tmp_path):
    from hpc_tools.submission import new_run, plan_submission

    plan = plan_submission(REPO / COMM, profile="local", executor="local", check_fit=False)
    run = new_run(plan.recipe, tmp_path / "runs", "local", COMM)
    manifest = run.manifest()
    assert manifest["site_file"] == str(site)
    saved = yaml.safe_load(run.recipe_path.read_text())
    assert saved["cluster"]["account"] == "proj42"  # the run folder's recipe is complete: no site file needed later
    text = run.recipe_path.read_text()
    assert dump_resolved(resolve(parse_yaml(text))) == text  # read back the same, whatever site file is in use

"""cluster.sbatch_extra: extra #SBATCH directives, rendered on both launch paths, refused when malformed or when the
schema owns the flag (naming the field to set instead)."""

from __future__ import annotations

import pytest

from hpc_tools.errors import RecipeError
from hpc_tools.recipe.cluster import OWNED_FLAGS
from hpc_tools.recipe.load import resolve
from hpc_tools.render.sbatch import render_sbatch
from hpc_tools.render.slurm_params import SlurmSpec
from tests.unit.test_render import small_recipe, submitit_script

EXTRA = ["--gres-flags=enforce-binding", "--gpu-bind=closest", "--mail-type=END,FAIL", "--mail-user=a.b@c.org",
         "--hint=nomultithread", "--comment=x_y"]


def test_rendered_on_both_paths(tmp_path):
    recipe = resolve(small_recipe(sbatch_extra=EXTRA))
    script = render_sbatch(recipe, "extra.yaml").splitlines()
    assert [ln for ln in script if ln.startswith("#SBATCH")][-len(EXTRA):] == [f"#SBATCH {x}" for x in EXTRA]
    from hpc_tools.submission import new_run

    run_dir = new_run(recipe, tmp_path / "runs", "slurm", "extra.yaml").path
    submitit = submitit_script(recipe, run_dir).splitlines()
    for x in EXTRA:
        assert f"#SBATCH {x}" in submitit, x


@pytest.mark.parametrize("item, told", [
    ("mail-type=END", "not an #SBATCH directive"),
    ("-p gpu", "not an #SBATCH directive"),
    ("--mail-type=END --x", "not an #SBATCH directive"),
    ("--mail-type=END\n#SBATCH --partition=x", "holds a newline"),  # refused by the schema for every string
    ("--comment=$(touch pwned)", "not an #SBATCH directive"),
    ("--comment='a'", "not an #SBATCH directive"),
    ("--Mail-type=END", "not an #SBATCH directive"),
    ("--", "not an #SBATCH directive"),
    ("--partition=debug", "holds --partition, which hpc_tools sets itself (set cluster.partition)"),
    ("--nodes=4", "(set cluster.nodes)"),
    ("--time=10", "(set cluster.time_limit)"),
    ("--gres=gpu:4", "(set cluster.gpus_per_node"),
    ("--output=x.out", "the log's place is fixed"),
    ("--exclusive", "(set cluster.exclusive)"),
    ("--export=NONE", "the job needs the variables"),
    ("--switches=1@00:10:00", "(set cluster.switches)"),
])
def test_refused_with_the_field_to_use(item, told):
    with pytest.raises(RecipeError) as err:
        resolve(small_recipe(sbatch_extra=["--mail-type=END", item]), source="extra.yaml")
    message = str(err.value)
    assert "\n" not in message and message.startswith("extra.yaml: cluster.sbatch_extra=") and told in message


def test_every_flag_hpc_tools_renders_is_owned():
    """The refusal table covers every flag SlurmSpec writes: an extra directive can never duplicate one."""
    spec = SlurmSpec.from_recipe(resolve(small_recipe(partition="p", account="a", qos="q", constraint="c",
                                                      reservation="r", exclusive=True, mem_gb=4)))
    rendered = {line.split()[1][2:].split("=")[0] for line in spec.sbatch_lines()}
    assert rendered <= set(OWNED_FLAGS), rendered - set(OWNED_FLAGS)
    assert resolve(small_recipe(requeue=False)).cluster.requeue is False and "requeue" in OWNED_FLAGS

"""scripts/probe_step_kernels.py: kernels attributed to the innermost frame of the repository's code
in the stack trace XLA keeps with each instruction (a hand-written dump: no compile)."""

from scripts.probe_step_kernels import attribute

HLO = """HloModule jit_step

FileNames
1 "/REPO/glm53/sampling.py"
2 "/REPO/.venv/lib/python3.12/site-packages/jax/_src/numpy/x.py"
3 "/REPO/serving/step_program.py"

FunctionNames
1 "sample_tokens"
2 "argsort"
3 "step"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=5 end_line=5 column=1 end_column=2}
3 {file_name_id=3 function_name_id=3 line=7 end_line=7 column=1 end_column=2}

StackFrames
1 {file_location_id=3 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=1}
3 {file_location_id=2 parent_frame_id=2}

ENTRY %main {
  %sort_fusion = f32[4] fusion(f32[4] %p), kind=kLoop, metadata={op_name="jit(step)/sort" stack_frame_id=3}
  %add_fusion.2 = f32[4] fusion(f32[4] %p), kind=kLoop, metadata={op_name="jit(step)/add" stack_frame_id=1}
  ROOT %concatenate.3 = f32[8] concatenate(f32[4] %p, f32[4] %p), dimensions={0}
}
"""


def test_each_kernel_goes_to_the_innermost_frame_of_ours(tmp_path):
    hlo = tmp_path / "module_0001.jit_step.cpu_after_optimizations.txt"
    hlo.write_text(HLO)
    for obj in ("sort_fusion_kernel_module", "__compute_module_add_fusion.2", "__compute_module_concatenate.3"):
        (tmp_path / f"module_0001.jit_step.obj-file.{obj}.o").write_bytes(b"")
    r = attribute(str(hlo), "/REPO")
    assert r["kernels"] == 3
    # the sort's innermost frame is jax's (site-packages: skipped), then sample_tokens, then step
    assert r["by_file"] == {"glm53/sampling.py": 1, "serving/step_program.py": 1,
                            "(no frame of ours) concatenate": 1}
    assert r["by_function"]["sampling.py:sample_tokens < step_program.py:step"] == 1

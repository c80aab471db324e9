"""The op library's first-use messages lead somewhere: a missing header set is said before any
build is announced, with the one command that fixes it; no package that does not exist is
suggested; CUDA kernels are compiled on first use only where a GPU is."""

from __future__ import annotations

import pytest
from loopcast.custom_ops import build, library

from loopcast.errors import LoopcastError


def test_missing_headers_name_the_fix_before_any_build(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("LOOPCAST_CACHE", str(tmp_path))
    monkeypatch.setenv("LOOPCAST_NO_FETCH", "1")
    monkeypatch.setattr(build, "find_ort_include", lambda: None)  # a machine without the headers
    with pytest.raises(LoopcastError, match=r"C headers .* missing: run tools/c_generate/fetch_deps.sh"):
        library.custom_op_library()
    err = capsys.readouterr().err
    assert "building" not in err and "several minutes" not in err


def test_headers_are_fetched_on_first_use_or_the_failure_names_the_fix(monkeypatch, tmp_path, capsys) -> None:
    """Without apt (not a Debian machine) the fetch fails at once and says what to do."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to(shutil.which("bash"))
    for tool in ("dirname", "mktemp", "rm", "mkdir"):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("LOOPCAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LOOPCAST_NO_FETCH", raising=False)
    monkeypatch.setattr(build, "find_ort_include", lambda: None)
    with pytest.raises(LoopcastError, match=r"could not be fetched \(error: fetching .* needs apt-get"):
        build.fetch_ort_headers(log=lambda line: print(line))
    assert "fetching the ONNX Runtime C headers" in capsys.readouterr().out


def test_no_prebuilt_reason_suggests_no_package() -> None:
    prebuilt, why = library.usable_prebuilt()
    if prebuilt is None:
        assert "pip install" not in why and "loopcast-ops)" not in why


def test_cuda_on_first_use_needs_nvcc_and_a_gpu_or_the_switch(monkeypatch) -> None:
    monkeypatch.setenv("LOOPCAST_NO_CUDA", "1")
    assert not build.cuda_on_first_use()  # no nvcc: never
    monkeypatch.delenv("LOOPCAST_NO_CUDA")
    if build.find_nvcc() is None:
        pytest.skip("needs nvcc on the PATH")
    monkeypatch.delenv("LOOPCAST_CUDA", raising=False)
    assert build.cuda_on_first_use() == build.gpu_present()
    monkeypatch.setenv("LOOPCAST_CUDA", "1")
    assert build.cuda_on_first_use()


def test_the_stock_fallback_note_names_no_flag_the_demo_lacks(monkeypatch, tmp_path) -> None:
    """Without the library the export notes the stock fallback with the fix, and suggests no
    flag (``--allow-inexact`` is generate's, and `loopcast demo` takes none)."""
    from loopcast.exporter.export import ExportOptions, _resolve_op_set

    from loopcast.vocab import OpSet
    from tests.artifacts import config_of

    monkeypatch.setenv("LOOPCAST_CACHE", str(tmp_path))
    monkeypatch.setenv("LOOPCAST_NO_FETCH", "1")
    monkeypatch.setattr(build, "find_ort_include", lambda: None)
    monkeypatch.setattr(library, "usable_prebuilt", lambda: (None, "no prebuilt library installed"))
    notes: list[str] = []
    op_set, lib = _resolve_op_set(config_of("llama-tied-gqa"), ExportOptions(), notes.append)
    assert (op_set, lib) == (OpSet.STOCK, None)
    assert len(notes) == 1 and "tools/c_generate/fetch_deps.sh" in notes[0] and "--" not in notes[0]


def test_a_local_build_records_the_sources_it_was_built_from(monkeypatch, tmp_path) -> None:
    """Beside a fresh local build, the kernel sources' digest: what a copy carried to another
    machine is checked against (tools/gpu_machine/h200_run.sh setup) before it is used."""
    monkeypatch.setenv("LOOPCAST_CACHE", str(tmp_path))
    monkeypatch.setenv("LOOPCAST_NO_CUDA", "1")
    monkeypatch.setattr(library, "usable_prebuilt", lambda: (None, "no prebuilt library installed"))
    monkeypatch.setattr(build, "find_ort_include", lambda: tmp_path)

    def fake_build(out, cuda):  # the compile itself is tested elsewhere
        out.mkdir(parents=True, exist_ok=True)
        (out / build.LIBRARY_NAME).write_bytes(b"")

    monkeypatch.setattr(build, "build_library", fake_build)
    path = library.custom_op_library()
    assert (path.parent / library.SOURCE_STAMP).read_text() == build.source_digest()

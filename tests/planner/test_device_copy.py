"""The staging copy's runtime call (``planner.device_copy``), with a stand-in for the CUDA
runtime: what it is handed, when ``copy_`` runs instead, and how a failure retires it."""

from __future__ import annotations

import warnings

import pytest
import torch

from planner import device_copy


class FakeRuntime:
    """``cudaMemcpyAsync``'s stand-in: records its arguments, copies like the runtime would
    (the first ``nbytes`` of ``src`` to ``dst``), and returns ``error``."""

    def __init__(self, error: int = 0) -> None:
        self.calls: list[tuple] = []
        self.error = error
        self.tensors: dict[int, torch.Tensor] = {}

    def __call__(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> int:
        self.calls.append((dst, src, nbytes, kind, stream))
        if self.error == 0:
            n = nbytes // 4
            self.tensors[dst][:n] = self.tensors[src][:n]
        return self.error


@pytest.fixture
def runtime(monkeypatch):
    fake = FakeRuntime()
    monkeypatch.setattr(device_copy, "_memcpy_async", lambda: fake)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 1234 + i, raising=False)
    monkeypatch.setitem(device_copy._state, "on", True)
    monkeypatch.setitem(device_copy._state, "env", None)  # read again at the next copy
    monkeypatch.delenv("FORWARD_PLANNER_RAW_COPY", raising=False)
    return fake


def _buffers(fake: FakeRuntime, n_src: int, n_dst: int) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.arange(n_src, dtype=torch.int32) + 7
    dst = torch.zeros(n_dst, dtype=torch.int32)
    fake.tensors = {src.data_ptr(): src, dst.data_ptr(): dst}
    return src, dst


def test_one_runtime_call_on_the_current_stream_for_the_source_elements(runtime):
    src, dst = _buffers(runtime, 5, 9)
    device_copy.send(dst, src, 5, 0)
    assert runtime.calls == [(dst.data_ptr(), src.data_ptr(), 20, 1, 1234)]
    assert dst.tolist() == [7, 8, 9, 10, 11, 0, 0, 0, 0]


def test_another_current_device_goes_through_copy_(runtime, monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    src, dst = _buffers(runtime, 4, 6)
    device_copy.send(dst, src, 4, 0)
    assert runtime.calls == []
    assert dst.tolist() == [7, 8, 9, 10, 0, 0]


def test_turned_off_by_the_environment(runtime, monkeypatch):
    monkeypatch.setenv("FORWARD_PLANNER_RAW_COPY", "0")
    src, dst = _buffers(runtime, 3, 3)
    device_copy.send(dst, src, 3, 0)
    assert runtime.calls == [] and dst.tolist() == [7, 8, 9]


def test_the_environment_is_read_once_at_the_first_copy(runtime, monkeypatch):
    src, dst = _buffers(runtime, 2, 2)
    device_copy.send(dst, src, 2, 0)
    monkeypatch.setenv("FORWARD_PLANNER_RAW_COPY", "0")  # too late: said at the first copy
    device_copy.send(dst, src, 2, 0)
    assert len(runtime.calls) == 2


def test_a_failing_call_falls_back_once_and_for_good(runtime):
    runtime.error = 1  # cudaErrorInvalidValue
    src, dst = _buffers(runtime, 4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        device_copy.send(dst, src, 4, 0)
        device_copy.send(dst, src, 4, 0)
    assert len(runtime.calls) == 1  # retired after the first failure
    assert dst.tolist() == [7, 8, 9, 10]  # copy_ delivered anyway
    assert [w for w in caught if "cudaMemcpyAsync failed (error 1)" in str(w.message)]


def test_no_runtime_library_means_copy_(monkeypatch):
    monkeypatch.setattr(device_copy, "_memcpy_async", lambda: None)
    src, dst = torch.arange(3, dtype=torch.int32), torch.zeros(5, dtype=torch.int32)
    device_copy.send(dst, src, 3, 0)
    assert dst.tolist() == [0, 1, 2, 0, 0]


def test_the_mapped_runtime_library_is_found_by_its_file_name_and_only_if_alone():
    maps = [
        "7f00-7f01 r--p 00000000 08:01 1 /usr/lib/libc.so.6\n",
        "7f02-7f03 r--p 00000000 08:01 2 /opt/libcudart.so.13/libtorch.so\n",
        "7f04-7f05 r-xp 00000000 08:01 3 /site/nvidia/cu13/lib/libcudart.so.13\n",
    ]
    assert device_copy.cudart_in(maps) == "/site/nvidia/cu13/lib/libcudart.so.13"
    assert device_copy.cudart_in([*maps, maps[2]]) == "/site/nvidia/cu13/lib/libcudart.so.13"
    assert device_copy.cudart_in(maps[:2]) is None
    other = "7f06-7f07 r-xp 00000000 08:01 4 /site/ext/lib/libcudart.so.12\n"
    assert device_copy.cudart_in([*maps, other]) is None  # two runtimes: which is torch's?
    assert device_copy.cudart_in(["7f00-7f01 rw-p 00000000 00:00 0 \n"]) is None


def test_torchs_global_runtime_is_preferred_to_a_mapped_one(monkeypatch):
    """The global symbol (torch loads its runtime first, into the global scope) wins; the
    mapped library is read only without it."""

    class Symbol:
        argtypes = restype = None

    opened: list = []
    state = {"global_missing": False}

    class FakeCDLL:
        def __init__(self, path):
            opened.append(path)
            if path is not None or not state["global_missing"]:
                self.cudaMemcpyAsync = Symbol()

    monkeypatch.setattr(device_copy.ctypes, "CDLL", FakeCDLL)
    monkeypatch.setattr(device_copy, "_loaded_cudart", lambda: "/lib/libcudart.so.13")
    for missing, want in ((False, [None]), (True, [None, "/lib/libcudart.so.13"])):
        state["global_missing"] = missing
        opened.clear()
        device_copy._memcpy_async.cache_clear()
        assert device_copy._memcpy_async() is not None
        assert opened == want
    device_copy._memcpy_async.cache_clear()


def test_a_copy_past_either_buffers_end_is_refused(runtime):
    src, dst = _buffers(runtime, 5, 4)
    for numel in (5, -1):
        with pytest.raises(ValueError, match="staging copy of"):
            device_copy.send(dst, src, numel, 0)
    assert runtime.calls == []

"""The library threads (backends/library_thread.py): every call into a llama.cpp-family library on
one thread per build; a build loaded beside the serving one gets its own, and a thread ends with
its last backend, so that one OpenMP pool is left after a build switch."""
import threading

import pytest

from specdec.backends.library_thread import LibraryThread, for_new_backend, library_thread, own_library_thread


def on_which_thread():
    return threading.current_thread()


def test_a_library_thread_ends_with_its_last_backend_and_starts_again_when_called():
    library = LibraryThread("specdec-test-library")
    library.attach()
    library.attach()  # a target and its draft
    first = library.call(on_which_thread)
    assert first.name == "specdec-test-library" and first is not threading.current_thread()
    assert library.call(on_which_thread) is first  # every call on the one thread
    library.detach()
    first.join(0.2)
    assert first.is_alive()  # one backend is still open
    library.detach()
    first.join(5)
    assert not first.is_alive()  # and with it the thread's OpenMP pool
    again = library.call(on_which_thread)
    assert again is not first and again.is_alive()
    library.attach()
    library.detach()
    again.join(5)
    assert not again.is_alive()


def test_a_call_raises_the_libraries_exception_on_the_callers_thread():
    library = LibraryThread("specdec-test-library")

    def fails():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        library.call(fails)


def test_backends_loaded_beside_the_serving_ones_call_through_a_thread_of_their_own():
    assert for_new_backend() is library_thread
    seen_elsewhere = []
    with own_library_thread("specdec-llama-new") as own:
        assert own is not library_thread and for_new_backend() is own
        other = threading.Thread(target=lambda: seen_elsewhere.append(for_new_backend()))
        other.start()
        other.join()
        assert own.call(on_which_thread).name == "specdec-llama-new"
    assert seen_elsewhere == [library_thread]  # another thread's loads are not affected
    assert for_new_backend() is library_thread

"""What our kernels' calls share (`engine/native.py`)."""

from __future__ import annotations

import numpy as np

from kazeia_stream.engine import native


def test_an_array_s_data_address_is_numpy_s_own_for_any_view():
    """`data` reads the array object's data field in place: the address numpy reports, for
    arrays that own their memory and views into others (slices, steps, transposes, offsets),
    of any type and size, empty ones too."""
    base = np.arange(7 * 12, dtype=np.float32).reshape(7, 12)
    arrays = [
        base,
        base[2:, 3:],
        base[:, 5],
        base.T,
        base[::2, ::-3],
        np.asfortranarray(base)[1:],
        base.view(np.uint8)[3:],
        np.empty(0, np.float16),
        np.zeros((2, 0, 3)),
        np.frombuffer(bytearray(64), np.int64)[1:],
    ]
    for a in arrays:
        assert native.data(a) == a.__array_interface__["data"][0]

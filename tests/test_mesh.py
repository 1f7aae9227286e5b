"""make_mesh: layout, subsets and the errors users hit."""

import types

import jax
import numpy as np
import pytest

from tp_jax.parallel.mesh import AXES, check_tp_groups, make_mesh


def test_eight_devices_tp_innermost():
    mesh = make_mesh(2, 2, 2)
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {"dp": 2, "pp": 2, "tp": 2}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    np.testing.assert_array_equal(ids.reshape(-1), np.arange(8))
    assert list(ids[1, 0]) == [4, 5]        # a tp group is consecutive devices
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_subset_of_devices_for_tp3():
    mesh = make_mesh(tp=3, devices=jax.devices()[:3])
    assert mesh.devices.size == 3 and mesh.shape["tp"] == 3


@pytest.mark.parametrize("kw", [dict(tp=0), dict(dp=-1), dict(pp=1.5), dict(tp=True)])
def test_invalid_sizes(kw):
    with pytest.raises(ValueError, match="positive integer"):
        make_mesh(**kw)


def test_product_mismatch_names_the_fix():
    with pytest.raises(ValueError, match=r"dp\*pp\*tp = 1\*1\*4 = 4 but 8 devices.*devices=jax.devices\(\)\[:4\]"):
        make_mesh(tp=4)


def test_tp_group_spanning_processes_is_refused():
    devs = [types.SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
    grid = np.empty(8, dtype=object)
    grid[:] = devs
    check_tp_groups(grid.reshape(2, 1, 4))           # 4 per process: fine
    with pytest.raises(ValueError, match=r"spans processes \[0, 1\].*tp <= .* \(4\)"):
        check_tp_groups(grid.reshape(1, 1, 8))

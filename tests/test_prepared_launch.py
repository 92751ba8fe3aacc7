

def test_every_prepared_table_is_registered_and_cleared_at_once():
    from flashmoe_science.attention import autograd, call
    from flashmoe_science.attention.hopper import backend
    from flashmoe_science.moe import execute, launch
    from flashmoe_science.prepared_cache import TABLES, clear_prepared

    tables = (call.PREPARED, call.PREPARED_PACKED, backend.PREPARED_FORWARD, autograd.BACKWARD_PLANS, execute.PREPARED,
              launch._PREPARED)
    assert all(any(t is registered for registered in TABLES.values()) for t in tables)
    assert len({id(t) for t in tables}) == 6
    call.PREPARED[("probe",)] = None
    launch._PREPARED[("probe",)] = None
    clear_prepared()
    assert not call.PREPARED and not launch._PREPARED

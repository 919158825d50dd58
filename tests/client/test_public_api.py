import agentjet_client
import agentjet_server


def test_all_is_sorted_and_importable():
    for module in (agentjet_client, agentjet_server):
        assert module.__all__ == sorted(module.__all__)
        for name in module.__all__:
            assert getattr(module, name) is not None

def test_placeholder() -> None:
    pass

"""What several test modules share; pytest.ini puts tests/ on the path (`from helpers.X import`)."""

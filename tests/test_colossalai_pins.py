"""docs/coming_from.md says why ColossalAI is not installed; scripts/check_colossalai_pins.py checks it against the
release's published requirements. Its logic, offline: a pin outside a requirement's range is a conflict."""

from test_reference import load_script


def test_a_pin_outside_a_requirements_range_is_a_conflict_and_unpinned_packages_are_left_out():
    script = load_script("check_colossalai_pins")
    pins = script.course_pins("# pinned\ntorch==2.13.0\npeft==0.21.2  # adapters\njupyterlab_widgets==3.0.17\n")
    assert pins == {"torch": "2.13.0", "peft": "0.21.2", "jupyterlab-widgets": "3.0.17"}
    rows = script.conflicts(["torch>=2.2.0,<=2.5.1", "peft>=0.7.1", "ray", "Jupyterlab_Widgets", "# a comment", ""],
                            pins)
    assert rows == [("torch", "<=2.5.1,>=2.2.0", "2.13.0", False), ("peft", ">=0.7.1", "0.21.2", True),
                    ("Jupyterlab_Widgets", "any", "3.0.17", True)]

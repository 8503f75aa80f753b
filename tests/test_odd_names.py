"""Long, odd and non-string folder names (issue 45, item 7): the Dataset node's validation, its run and the preview
route answer a clear error (the route a 4xx), never an OSError or AttributeError. The real server's cases are in
test_hostile_server.py."""
import pytest

from helpers import PACK, node_module

NAMES = {  # case -> (folder value, what the answer says)
    "5000_characters": ("a" * 5000, "5,000 characters long"),
    "300_dots": ("." * 300, "300 characters long"),
    "long_part_in_a_path": ("photos/" + "b" * 300, "characters long"),
    "a_number": (5, "got the int 5, not a folder name"),
    "a_list": (["x"], "got the list ['x'], not a folder name"),
}


@pytest.fixture()
def dataset_node(tmp_path, monkeypatch):
    import folder_paths
    monkeypatch.setattr(folder_paths, "get_input_directory", lambda: str(tmp_path))
    return node_module("dataset")


@pytest.mark.parametrize("case", list(NAMES))
def test_the_dataset_node_refuses_an_odd_name_with_a_clear_error(dataset_node, case):
    """Before: ENAMETOOLONG from links_problem (HTTP 500 in the preview, "File name too long" when run) and
    AttributeError: 'int' object has no attribute 'strip' for a number."""
    value, says = NAMES[case]
    errors = __import__(f"{PACK}.trainer.errors", fromlist=["LeanLoRAError"])
    problem = dataset_node.LeanLoRADataset.VALIDATE_INPUTS(folder=value)
    assert isinstance(problem, str) and says in problem and "folder" in problem
    assert len(problem) < 600  # the name is cut, not echoed whole
    with pytest.raises(errors.LeanLoRAError, match="folder"):
        dataset_node.LeanLoRADataset().execute(value, 64, 1, "", "center crop (square)")
    assert dataset_node.LeanLoRADataset.VALIDATE_INPUTS(folder=None) is True  # a link: checked when it runs


@pytest.mark.parametrize("case", [case for case, (value, _) in NAMES.items() if isinstance(value, str)])
def test_the_preview_route_answers_an_odd_name_with_a_4xx(dataset_node, tmp_path, case):
    value, says = NAMES[case]
    status, answer = node_module("routes").folder_preview(value, tmp_path)
    assert 400 <= status < 500 and says in answer["error"]

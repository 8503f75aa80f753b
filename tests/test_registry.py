"""What the Comfy registry and ComfyUI-Manager read from this repository (issue 33 item 6): pyproject.toml as
ComfyUI's own comfy_config parser reads it (the same fields comfy-cli publishes), the LICENSE, the icon, and the
file set `.comfyignore` leaves in the published node. No server: ComfyUI's parser is a plain module."""
import re
import subprocess
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[1]
RUNTIME = ["__init__.py", "nodes/", "trainer/", "bridge/", "web/leanlora.js", "example_workflows/",
           "requirements.txt", "pyproject.toml", "README.md", "LICENSE", "docs/icon.png"]


def test_pyproject_reads_as_the_registry_reads_it():
    from comfy_config.config_parser import extract_node_configuration
    config = extract_node_configuration(str(REPO))
    project, comfy = config.project, config.tool_comfy
    assert project.supported_os == ["POSIX :: Linux"] and project.supported_accelerators == ["GPU :: NVIDIA CUDA"]
    assert re.fullmatch(r">=\d+\.\d+\.\d+", project.supported_comfyui_version), project.supported_comfyui_version
    repository = project.urls.repository
    assert repository.startswith("https://github.com/")
    assert project.urls.documentation.startswith(repository) and project.urls.issues == f"{repository}/issues"
    assert project.license.text == "MIT" and (REPO / "LICENSE").read_text().startswith("MIT License\n")
    owner_and_name = repository.removeprefix("https://github.com/")
    assert comfy.icon == f"https://raw.githubusercontent.com/{owner_and_name}/main/docs/icon.png"
    with Image.open(REPO / "docs" / "icon.png") as icon:  # the registry shows a square of at most 400 px
        assert icon.format == "PNG" and icon.width == icon.height <= 400
    assert comfy.publisher_id and comfy.display_name


def _published() -> dict[str, int]:
    """The git-tracked files .comfyignore keeps, with their sizes. The file uses only root-anchored folder and
    file patterns ('/x/', '/x/*', '!/x/y'), whose gitwildmatch meaning this reads exactly (last match wins)."""
    rules = [line for line in (REPO / ".comfyignore").read_text().splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r"!?/[\w./-]+(/|/\*)?", rule) for rule in rules), rules
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    kept = {}
    for name in tracked.splitlines():
        excluded = False
        for rule in rules:
            pattern = rule.lstrip("!").lstrip("/")
            if pattern.endswith("/*"):
                hit = name.startswith(pattern[:-1]) and "/" not in name[len(pattern) - 1:]
            else:
                hit = name.startswith(pattern) if pattern.endswith("/") else name == pattern
            if hit:
                excluded = not rule.startswith("!")
        if not excluded and (REPO / name).is_file():
            kept[name] = (REPO / name).stat().st_size
    return kept


def test_the_published_node_holds_what_runs_and_leaves_out_tests_and_results():
    kept = _published()
    for needed in RUNTIME:
        assert any(name == needed or name.startswith(needed) for name in kept), needed
    assert not [n for n in kept if n.startswith(("tests/", "bench/", "docs/results/", "scripts/"))]
    # the pack imports nothing from what is left out
    for name in kept:
        if name.endswith(".py"):
            source = (REPO / name).read_text()
            assert not re.search(r"^\s*(from|import)\s+\.*(tests|bench|scripts)\b", source, re.M), name
    # README's pictures still show where the registry renders it from the published files
    readme = (REPO / "README.md").read_text()
    for picture in re.findall(r"\]\(((?:docs|example_workflows)/[^)\s]+\.(?:jpg|png))\)", readme):
        assert picture in kept, picture
    # tests, bench and measured results were about 2.8 of the repository's 3.35 MB (issue 33)
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    total = sum((REPO / name).stat().st_size for name in tracked if (REPO / name).is_file())
    assert sum(kept.values()) < total / 3, sorted(kept.items(), key=lambda item: -item[1])[:10]

"""Writes the files of a bare git directory's HEAD into a folder, skipping blobs the snapshot lacks (the search
tool's fetch keeps a repository's largest files out): `python3 bench/git_snapshot.py GIT_DIR OUT_DIR`.
Used by bench/prepare_gpu_carry.sh (ComfyUI 0.33) and bench/kohya_peer.sh (kohya sd-scripts)."""
import os
import subprocess
import sys


def export(git_dir: str, out: str) -> list[str]:
    git = ["git", "--git-dir", git_dir]
    listing = subprocess.run([*git, "ls-tree", "-r", "-z", "HEAD"], capture_output=True, check=True).stdout
    cat = subprocess.Popen([*git, "cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    missing = []
    for line in filter(None, listing.split(b"\0")):
        meta, path = line.split(b"\t", 1)
        mode, kind, sha = meta.split()
        if kind != b"blob":
            continue
        cat.stdin.write(sha + b"\n")
        cat.stdin.flush()
        header = cat.stdout.readline().split()
        if header[1] == b"missing":
            missing.append(path.decode())
            continue
        data = cat.stdout.read(int(header[2]))
        cat.stdout.read(1)
        dest = os.path.join(out, path.decode())
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if mode == b"120000":
            os.symlink(data.decode(), dest)
        else:
            with open(dest, "wb") as f:
                f.write(data)
            if mode == b"100755":
                os.chmod(dest, 0o755)
    cat.stdin.close()
    cat.wait()
    return missing


if __name__ == "__main__":
    absent = export(sys.argv[1], sys.argv[2])
    print(f"[snapshot] {sys.argv[1]}: files absent from the snapshot, skipped: {absent or 'none'}")

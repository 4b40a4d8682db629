"""cuobjdump / nvdisasm (pip wheels nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm, else PATH) for the SASS tests."""
import glob
import os
import re
import shutil
import site
import subprocess


def nv_bin(name: str) -> str | None:
    for d in site.getsitepackages() + [site.getusersitepackages()]:
        for pattern in ("nvidia/*/bin", "nvidia/*/*/bin"):
            hits = glob.glob(os.path.join(d, pattern, name))
            if hits:
                return hits[0]
    return shutil.which(name)


def dump(cubin: bytes, folder, *args: str) -> subprocess.CompletedProcess:
    """`cuobjdump *args` on the cubin (written into `folder`), with nvdisasm on PATH; None without cuobjdump."""
    tool = nv_bin("cuobjdump")
    if tool is None:
        return None
    path = os.path.join(str(folder), "k.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    env = dict(os.environ)
    disasm = nv_bin("nvdisasm")
    if disasm:
        env["PATH"] = os.path.dirname(disasm) + os.pathsep + env.get("PATH", "")
    return subprocess.run([tool, *args, path], capture_output=True, text=True, env=env)


def resources(cubin: bytes, folder) -> dict | None:
    """{'REG': n, 'STACK': n, 'SHARED': n, 'LOCAL': n, ...} of the cubin's one kernel (None without cuobjdump)."""
    res = dump(cubin, folder, "--dump-resource-usage")
    if res is None:
        return None
    return {k: int(v) for k, v in re.findall(r"\b([A-Z]+):(\d+)", res.stdout)}

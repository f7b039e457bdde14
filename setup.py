"""The CPU kernel (cacheidx/attention/native/kernel.c), built as an extension module when
cacheidx is installed; everything else is in pyproject.toml.

The extension is optional: where no C compiler builds it, the install goes on (setuptools says
why) and the array libraries' products read quantized and paged pools instead
(cacheidx.attention.native says so once, as a warning). Its flags keep one set of numerics on
every machine: no -march=native (kernel.c builds its vector code at each width a processor may
offer and picks the widest at run time instead), no -ffast-math or reassociation, no
contraction into fused multiply-adds; OpenMP where the compiler links it (the kernel's threads
are then the process's OpenMP pool, torch's own)."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: GCC and clang: optimised, no errno from libm, and floats as the source writes them
UNIX = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-Wno-psabi"]


#: a program OpenMP must build and link, or the kernel takes its threads from pthreads
OPENMP = "#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n"


def openmp(compiler) -> list[str]:
    """``["-fopenmp"]`` where ``compiler`` compiles and links OpenMP (GCC with libgomp; the
    kernel then splits a call over the process's OpenMP threads, torch's own pool where torch
    is loaded), else ``[]``."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "openmp.c")
        with open(src, "w") as f:
            f.write(OPENMP)
        try:
            objects = compiler.compile([src], output_dir=tmp, extra_postargs=["-fopenmp"])
            compiler.link_executable(objects, "openmp", output_dir=tmp,
                                     extra_postargs=["-fopenmp"])
        except Exception:  # noqa: BLE001  (any failure: no OpenMP, pthreads instead)
            return []
    return ["-fopenmp"]


class Flags(build_ext):
    """``build_ext`` with the kernel's flags for the compiler it finds."""

    def build_extensions(self):
        unix = self.compiler.compiler_type == "unix"
        omp = openmp(self.compiler) if unix else []
        for ext in self.extensions:
            ext.extra_compile_args = UNIX + omp if unix else ["/O2", "/fp:precise"]
            ext.extra_link_args = ["-pthread", *omp] if unix else []
            ext.libraries = ["m"] if unix else []
        super().build_extensions()


setup(
    ext_modules=[Extension("cacheidx.attention.native._kernel",
                           ["cacheidx/attention/native/kernel.c"],
                           depends=["cacheidx/attention/native/lanes.h"], optional=True)],
    cmdclass={"build_ext": Flags},
)

// The extension is a plain shared library of torch ops (TORCH_LIBRARY_FRAGMENT in each
// op's source). This stub only lets `import entmax_fast._C` load it, which runs the
// op registrations; there is deliberately no pybind11 glue.
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

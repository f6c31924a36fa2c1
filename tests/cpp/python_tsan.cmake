# python_tests_tsan: pytest runs of several models training at once (two devices, shared host-step threads,
# re-plans, arrivals, checkpoints, the commit gate) with this project's native code under ThreadSanitizer.
#
# The extension module is built again here with -fsanitize=thread from the same sources as setup.py's, and
# loaded into the (uninstrumented) Python with libtsan preloaded. Python and LibTorch are not instrumented, so
# races are reported between this project's own reads and writes only, as in engine_tests_tsan (same
# suppressions). The fused kernels come from hydra_core, uninstrumented: their target_clones resolvers run
# while the module is being relocated, before an instrumented call could be made. The Python sources are
# staged beside the module by a fixture, so each run tests the checkout as it is.
find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)
execute_process(COMMAND ${Python3_EXECUTABLE} -c "import torch; print(torch.__version__)"
                OUTPUT_VARIABLE HYDRA_TORCH_VERSION OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libtsan.so
                OUTPUT_VARIABLE HYDRA_LIBTSAN OUTPUT_STRIP_TRAILING_WHITESPACE)
set(HYDRA_TSAN_PACKAGE ${CMAKE_CURRENT_BINARY_DIR}/python_tsan)

file(GLOB HYDRA_BINDING_SOURCES CONFIGURE_DEPENDS ${HYDRA_ROOT}/csrc/bindings/*.cpp)
Python3_add_library(hydra_python_tsan MODULE WITH_SOABI ${HYDRA_BINDING_SOURCES} ${HYDRA_ENGINE_SOURCES}
                    ${HYDRA_OP_SOURCES})
set_target_properties(hydra_python_tsan PROPERTIES OUTPUT_NAME _C
                      LIBRARY_OUTPUT_DIRECTORY ${HYDRA_TSAN_PACKAGE}/hydra_torch)
target_compile_definitions(hydra_python_tsan PRIVATE TORCH_EXTENSION_NAME=_C TORCH_API_INCLUDE_EXTENSION_H
                           HYDRA_TORCH_BUILT_TORCH_VERSION="${HYDRA_TORCH_VERSION}")
target_compile_options(hydra_python_tsan PRIVATE ${TORCH_CXX_FLAGS} -fsanitize=thread -O1 -g -fvisibility=hidden)
target_link_options(hydra_python_tsan PRIVATE -fsanitize=thread)
target_include_directories(hydra_python_tsan PRIVATE ${HYDRA_ROOT}/csrc)
target_link_libraries(hydra_python_tsan PRIVATE hydra_core ${TORCH_LIBRARIES}
                      ${TORCH_INSTALL_PREFIX}/lib/libtorch_python.so)

add_test(NAME python_tsan_stage
         COMMAND ${Python3_EXECUTABLE} -c "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2], \
dirs_exist_ok=True, ignore=shutil.ignore_patterns('*.so', '__pycache__'))"
                 ${HYDRA_ROOT}/hydra_torch ${HYDRA_TSAN_PACKAGE}/hydra_torch)
set_tests_properties(python_tsan_stage PROPERTIES FIXTURES_SETUP python_tsan)

set(HYDRA_TSAN_PYTESTS test_multi_model.py test_replan.py test_replan_placement.py test_arrivals.py
    test_request_stop.py test_checkpoint.py test_equivalence.py test_bad_input.py test_shard_placement.py
    test_host_lane.py test_leaving.py)
list(TRANSFORM HYDRA_TSAN_PYTESTS PREPEND ${HYDRA_ROOT}/tests/)
# Run from the build folder, so that the checkout's own hydra_torch (with its uninstrumented module) is not
# the one imported: the staged package comes first on the path, which the command checks before pytest.
add_test(NAME python_tests_tsan
         COMMAND ${Python3_EXECUTABLE} -c "import sys, pytest, hydra_torch._C as native; \
assert native.__file__.startswith(sys.argv[1]), native.__file__; \
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider'] + sys.argv[2:]))" ${HYDRA_TSAN_PACKAGE} ${HYDRA_TSAN_PYTESTS}
         WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(python_tests_tsan PROPERTIES FIXTURES_REQUIRED python_tsan TIMEOUT 1800 ENVIRONMENT
                     "LD_PRELOAD=${HYDRA_LIBTSAN};PYTHONPATH=${HYDRA_TSAN_PACKAGE}:${HYDRA_ROOT}/tests;\
TSAN_OPTIONS=halt_on_error=1 suppressions=${CMAKE_CURRENT_SOURCE_DIR}/tsan_suppressions.txt")

# Third-party dependencies, all from distribution packages (Debian 12 and Ubuntu 24.04 versions).
find_package(Threads REQUIRED)
find_package(MPI REQUIRED COMPONENTS CXX)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(GTest REQUIRED)

# yaml-cpp 0.7 exports the target `yaml-cpp`, 0.8 `yaml-cpp::yaml-cpp`.
find_package(yaml-cpp REQUIRED)
if(TARGET yaml-cpp::yaml-cpp)
  set(DFLASH_YAML_TARGET yaml-cpp::yaml-cpp)
else()
  set(DFLASH_YAML_TARGET yaml-cpp)
endif()

# HDF5 C library; Debian/Ubuntu ship it as hdf5/serial.
set(HDF5_PREFER_PARALLEL OFF)
find_package(HDF5 REQUIRED COMPONENTS C)

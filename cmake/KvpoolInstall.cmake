# cmake/KvpoolInstall.cmake — `cmake --install BUILD --prefix P` and the CMake package `kvpool`
# (docs/README.md "Using the C++ client from another project"). Included last by the top-level
# CMakeLists.txt, when every target exists.
#
# Installs, under P:
#   component Development: lib/libkvpool_{client,common,kernels,transport,proto}.a (the client
#     and the static libraries its link interface names), their public headers under include/
#     (kvpool/client, kvpool/common without cli.h, kvpool/kernels without cuda/,
#     kvpool/transport), the contract share/kvpool/proto/kvpool/v1/pool.proto, and
#     lib/cmake/kvpool/{kvpoolConfig,kvpoolConfigVersion,kvpoolTargets*}.cmake;
#   component Runtime: bin/kvpool-server, bin/kvpool, bin/kvpool-engine, bin/kvpool-worker.
# A consumer writes `find_package(kvpool CONFIG REQUIRED)` and links `kvpool::client`; the
# config file finds gRPC, protobuf, Abseil, UCX, xxhash, ... the way this build does
# (cmake/kvpoolConfig.cmake.in). tests/install/ is the check (ctest -R install_consumer).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(KVPOOL_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvpool)

# The client and every library of ours its link interface names (static libraries carry their
# private dependencies as $<LINK_ONLY:...>, kvpool_warnings included), as kvpool::<name>.
set(_kvpool_exported
  kvpool_client:client kvpool_common:common kvpool_kernels:kernels
  kvpool_transport:transport kvpool_proto:proto kvpool_warnings:internal_warnings)
set(_kvpool_export_targets)
foreach(_pair IN LISTS _kvpool_exported)
  string(REPLACE ":" ";" _pair "${_pair}")
  list(GET _pair 0 _target)
  list(GET _pair 1 _name)
  set_target_properties(${_target} PROPERTIES EXPORT_NAME ${_name})
  # The component CMakeLists give source/build-tree include directories; installed, the
  # headers are under include/.
  get_target_property(_dirs ${_target} INTERFACE_INCLUDE_DIRECTORIES)
  if(_dirs)
    set(_wrapped)
    foreach(_d IN LISTS _dirs)
      if(_d MATCHES "^\\$<")
        list(APPEND _wrapped "${_d}")
      else()
        list(APPEND _wrapped "$<BUILD_INTERFACE:${_d}>")
      endif()
    endforeach()
    list(APPEND _wrapped "$<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>")
    set_target_properties(${_target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_wrapped}")
  endif()
  list(APPEND _kvpool_export_targets ${_target})
endforeach()
# The client's headers use C++20; say so to consumers.
set_property(TARGET kvpool_client APPEND PROPERTY INTERFACE_COMPILE_FEATURES cxx_std_20)

install(TARGETS ${_kvpool_export_targets} EXPORT kvpoolTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT Development
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT Development)
install(EXPORT kvpoolTargets NAMESPACE kvpool:: DESTINATION ${KVPOOL_INSTALL_CMAKEDIR}
  COMPONENT Development)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/client/include/ ${PROJECT_SOURCE_DIR}/transport/include/
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT Development FILES_MATCHING PATTERN "*.h")
# cli.h is the flag convention of our binaries (CLI11, library kvpool_cli: not installed).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/common/include/
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT Development
  FILES_MATCHING PATTERN "*.h" PATTERN "cli.h" EXCLUDE)
# kernels/include/kvpool/kernels/cuda/ belongs to the CUDA kernels library (not installed).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/kernels/include/
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT Development
  FILES_MATCHING PATTERN "*.h" PATTERN "cuda" EXCLUDE)
install(FILES ${PROJECT_SOURCE_DIR}/proto/kvpool/v1/pool.proto
  DESTINATION ${CMAKE_INSTALL_DATADIR}/kvpool/proto/kvpool/v1 COMPONENT Development)

configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/kvpoolConfig.cmake.in
  ${CMAKE_BINARY_DIR}/cmake/kvpoolConfig.cmake
  INSTALL_DESTINATION ${KVPOOL_INSTALL_CMAKEDIR})
# 0.x: a minor release may change the API.
write_basic_package_version_file(${CMAKE_BINARY_DIR}/cmake/kvpoolConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/cmake/kvpoolConfig.cmake
              ${CMAKE_BINARY_DIR}/cmake/kvpoolConfigVersion.cmake
  DESTINATION ${KVPOOL_INSTALL_CMAKEDIR} COMPONENT Development)

# Binaries (whichever this configuration builds).
foreach(_bin kvpool-server kvpool_cli_tool kvpool_engine_cli kvpool_worker_cli)
  if(TARGET ${_bin})
    install(TARGETS ${_bin} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT Runtime)
  endif()
endforeach()

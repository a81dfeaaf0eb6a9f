# What the engine must not reach, checked where its link cannot see it (header-only Boost links
# without complaint): no source of apus_core and no public header includes the server's, the
# hub's or the ranks' (dist/) headers, Boost, libcurl, OpenSSL or MPI; the public headers include nothing of src/; and
# libapus_core.a defines or asks for no Boost, libcurl or libcrypto symbol. Then the layers: the
# networks (models/) never include a pipeline; ops, io, core, text, sampling and cost include
# neither; the front ends (apps/, server, hub, gate) include no family's folder (models/<family>/,
# pipeline/<family>/), only what every family shares; a family's folder never includes the registry
# that lists it.
#   cmake -DSOURCE_DIR=<tree> -DARCHIVE=<libapus_core.a> -DNM=<nm> -P core_deps.cmake
file(GLOB_RECURSE files RELATIVE ${SOURCE_DIR} ${SOURCE_DIR}/src/* ${SOURCE_DIR}/include/*)
list(FILTER files EXCLUDE REGEX "^src/(server|hub|dist)/")
set(found "")
foreach(file IN LISTS files)
  file(STRINGS ${SOURCE_DIR}/${file} includes REGEX "^[ \t]*#[ \t]*include")
  foreach(line IN LISTS includes)
    if(line MATCHES "[<\"](server|hub|dist|boost|curl|openssl)/" OR line MATCHES "[<\"]mpi\\.h" OR
       (file MATCHES "^include/" AND line MATCHES "\"" AND NOT line MATCHES "\"apus/"))
      string(APPEND found "\n  ${file}: ${line}")
    endif()
  endforeach()
endforeach()
if(found)
  message(FATAL_ERROR "the engine includes what is not its own:${found}")
endif()

file(GLOB_RECURSE sources RELATIVE ${SOURCE_DIR} ${SOURCE_DIR}/src/* ${SOURCE_DIR}/apps/*)
set(crossed "")
foreach(file IN LISTS sources)
  file(STRINGS ${SOURCE_DIR}/${file} includes REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(line IN LISTS includes)
    if((file MATCHES "^src/models/" AND line MATCHES "\"pipeline/") OR
       (file MATCHES "^src/(ops|io|core|text|sampling|cost)/" AND line MATCHES "\"(models|pipeline)/") OR
       (file MATCHES "^(apps|src/server|src/hub|src/gate|src/dist)/" AND line MATCHES "\"(models|pipeline)/[a-z0-9_]+/") OR
       (file MATCHES "^src/pipeline/[a-z0-9_]+/" AND line MATCHES "\"pipeline/registry.h\""))
      string(APPEND crossed "\n  ${file}: ${line}")
    endif()
  endforeach()
endforeach()
if(crossed)
  message(FATAL_ERROR "a layer includes one it must not (tests/core_only/core_deps.cmake):${crossed}")
endif()

execute_process(COMMAND ${NM} -C ${ARCHIVE} COMMAND grep -E "boost::| (curl|EVP|OPENSSL|SSL)_"
                OUTPUT_VARIABLE symbols RESULTS_VARIABLE status)
list(GET status 0 nm_status)
if(NOT nm_status EQUAL 0)
  message(FATAL_ERROR "${NM} could not read ${ARCHIVE}")
endif()
if(symbols)
  string(SUBSTRING "${symbols}" 0 2000 symbols)
  message(FATAL_ERROR "${ARCHIVE} carries the server's or the hub's symbols:\n${symbols}")
endif()

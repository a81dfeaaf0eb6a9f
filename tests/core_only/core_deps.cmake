# What the engine must not reach, checked where its link cannot see it (header-only Boost links
# without complaint): no source of apus_core and no public header includes the server's or the
# hub's headers, Boost, libcurl or OpenSSL; the public headers include nothing of src/; and
# libapus_core.a defines or asks for no Boost, libcurl or libcrypto symbol.
#   cmake -DSOURCE_DIR=<tree> -DARCHIVE=<libapus_core.a> -DNM=<nm> -P core_deps.cmake
file(GLOB_RECURSE files RELATIVE ${SOURCE_DIR} ${SOURCE_DIR}/src/* ${SOURCE_DIR}/include/*)
list(FILTER files EXCLUDE REGEX "^src/(server|hub)/")
set(found "")
foreach(file IN LISTS files)
  file(STRINGS ${SOURCE_DIR}/${file} includes REGEX "^[ \t]*#[ \t]*include")
  foreach(line IN LISTS includes)
    if(line MATCHES "[<\"](server|hub|boost|curl|openssl)/" OR
       (file MATCHES "^include/" AND line MATCHES "\"" AND NOT line MATCHES "\"apus/"))
      string(APPEND found "\n  ${file}: ${line}")
    endif()
  endforeach()
endforeach()
if(found)
  message(FATAL_ERROR "the engine includes what is not its own:${found}")
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

/* SPDX-License-Identifier: MIT */
/* tests/net.h — which local addresses listen on a TCP port, read from
 * /proc/net/tcp{,6} (the store and cparrun suites check where the store
 * binds). */
#ifndef CPAR_TESTS_NET_H
#define CPAR_TESTS_NET_H

#include <stdio.h>
#include <string.h>

/* The local addresses (hex as /proc/net/tcp writes them, e.g. "0100007F")
 * of sockets listening on port, IPv4 and IPv6 together, space-separated. */
static inline void tu_listening_on(int port, char *out, size_t n) {
    out[0] = '\0';
    const char *files[] = {"/proc/net/tcp", "/proc/net/tcp6"};
    for (int f = 0; f < 2; f++) {
        FILE *fp = fopen(files[f], "r");
        if (!fp) continue;
        char line[512], addr[64];
        unsigned p, state;
        while (fgets(line, sizeof line, fp))
            if (sscanf(line, " %*d: %63[0-9A-Fa-f]:%x %*[0-9A-Fa-f]:%*x %x", addr, &p, &state) == 3 &&
                (int)p == port && state == 0x0A /* LISTEN */) {
                size_t used = strlen(out);
                snprintf(out + used, n - used, "%s%s", used ? " " : "", addr);
            }
        fclose(fp);
    }
}

#endif

// A crash reporter to preload into a process that dies of SIGSEGV/SIGBUS/SIGILL/SIGFPE/SIGABRT with no native
// frames to show (Python's faulthandler prints only Python's). For the faulting instruction and every frame it
// prints the library and the offset inside it, which `addr2line -f -C -e LIB OFFSET` turns into a source line
// for anything built with -g (tools/resolve_frames.py does that for a whole log):
//   cc -shared -fPIC -O1 -o /tmp/segv_backtrace.so tools/segv_backtrace.c
//   LD_PRELOAD=/tmp/segv_backtrace.so python3 -m pytest -p no:faulthandler ...
// The pc is read from the signal context first, so the report says where the fault was even if walking the
// stack faults again (the handler is reset on entry, so a second fault ends the process).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

static void print_frame(const char* label, void* pc) {
  char line[768];
  Dl_info info;
  int n;
  if (dladdr(pc, &info) && info.dli_fname) {
    n = snprintf(line, sizeof line, "hydra-segv %s %p %s+%#lx (%s)\n", label, pc, info.dli_fname,
                 (unsigned long)((char*)pc - (char*)info.dli_fbase), info.dli_sname ? info.dli_sname : "?");
  } else {
    n = snprintf(line, sizeof line, "hydra-segv %s %p ?\n", label, pc);
  }
  if (n > 0) (void)!write(2, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

static void report(int sig, siginfo_t* info, void* context) {
  char line[256];
  int n = snprintf(line, sizeof line, "hydra-segv signal %d (%s), fault address %p, thread %ld\n", sig,
                   strsignal(sig), info->si_addr, (long)gettid());
  if (n > 0) (void)!write(2, line, (size_t)n);
#if defined(__x86_64__)
  print_frame("pc", (void*)((ucontext_t*)context)->uc_mcontext.gregs[REG_RIP]);
#endif
  void* frames[96];
  int count = backtrace(frames, 96);
  for (int i = 0; i < count; ++i) {
    char label[16];
    snprintf(label, sizeof label, "#%d", i);
    print_frame(label, frames[i]);
  }
  raise(sig);  // the default action, now that the handler is reset: the exit status stays a crash
}

__attribute__((constructor)) static void install(void) {
  static char alternate_stack[1 << 16];
  const stack_t stack = {.ss_sp = alternate_stack, .ss_size = sizeof alternate_stack, .ss_flags = 0};
  sigaltstack(&stack, NULL);
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_sigaction = report;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  const int signals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
  for (size_t i = 0; i < sizeof signals / sizeof signals[0]; ++i) sigaction(signals[i], &action, NULL);
}

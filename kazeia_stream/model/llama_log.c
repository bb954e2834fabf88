/* llama.cpp's log callback, filtered in C. libllama calls its log callback for every message
   at every level (3185 times while it loads a Qwen3-TTS talker's vocabulary), and a Python
   callback takes the GIL at each one: the load, which runs in a thread while the model's other
   pieces load, waited on whatever Python the other threads ran (0.5 s alone, 15 s beside a
   thread looping in Python). This one passes to the Python callback only the messages at the
   levels the log wants. Its state is shared by the threads that log, hence atomic; a
   continuation line follows the last message any thread logged, as in llama.cpp's own log. */

typedef void (*kz_log_fn)(int level, const char *text, void *user_data);

enum { LEVEL_CONT = 5 }; /* ggml_log_level's GGML_LOG_LEVEL_CONT: the previous message goes on */

static kz_log_fn forward;
static int min_level = LEVEL_CONT; /* the least level passed on (CONT: none until set) */
static int passing;                /* whether the message that CONT continues was passed on */

/* Pass messages of `level` and above to `fn` from now on. */
void kz_log_set(kz_log_fn fn, int level) {
    __atomic_store_n(&forward, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&min_level, level, __ATOMIC_RELAXED);
}

/* The callback given to llama_log_set. */
void kz_log(int level, const char *text, void *user_data) {
    if (level != LEVEL_CONT)
        __atomic_store_n(&passing, level >= __atomic_load_n(&min_level, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    kz_log_fn fn = __atomic_load_n(&forward, __ATOMIC_RELAXED);
    if (fn && __atomic_load_n(&passing, __ATOMIC_RELAXED))
        fn(level, text, user_data);
}

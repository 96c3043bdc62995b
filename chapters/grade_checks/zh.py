"""The grader's checks in Chinese: each check's name and what it feeds in.

The Chinese exercise pages list every check of an exercise with these words
(``{{ grader_checks("4.1") }}`` on a ``.zh.md`` page), and
``python -m chapters.grade 4.1 --lang zh`` prints them. Keys are the
exercise id and the check's English name (``Check.name``); the second string
says in Chinese what the first paragraph of the check's docstring says in
English. tests/test_exercises.py fails when a check has no entry here, or an
entry names no check.

Chapters 1, 3-10 (the exercises). vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

# The two end-to-end checks exercises 4.1 and 4.3 share (4.2 takes the first).
_KV_CACHE_END_TO_END: dict[str, tuple[str, str]] = {
    'end to end: prefix cache': (
        "端到端：前缀缓存",
        (
            "三个 prompt 有一段 12 个 token 的共同前缀，每个贪心生成 8 个 token，每个 block 4 个 token："
            "缓存必须命中。"
        ),
    ),
    'end to end: preemption': (
        "端到端：抢占",
        (
            "四个各 7 个 token 的 prompt，每个贪心生成 16 个 token，只有 9 个可用 block，"
            "每个 block 4 个 token：FCFS 必须抢占。"
        ),
    ),
}

# Exercise id -> English check name -> (Chinese name, Chinese description of its inputs).
CHINESE: dict[str, dict[str, tuple[str, str]]] = {
    "1.1": {
        "returns your request's output once it is finished": (
            "你的请求一完成就返回它的输出",
            '请求 "mine" 每步得到一个 token，在它的第三步完成。',
        ),
        'skips the outputs of other requests, even finished ones': (
            "跳过别的请求的输出，已完成的也跳过",
            (
                '引擎里已有的请求 "other" 在第一步完成，"mine" 在这一步也有进展；第二步里 "mine" 完成，'
                '它的输出排在请求 "late" 的一个输出前面。'
            ),
        ),
        'keeps stepping after a step with no output': (
            "某一步没有输出，照样接着 step",
            (
                '请求 "mine" 分两个 chunk 做 prefill：第一步一个输出都不返回（`[]`），'
                "而 `has_unfinished_requests()` 仍是 True；它在第三步完成。"
            ),
        ),
        'never loops forever on an engine that has run dry': (
            "引擎跑空了，绝不无限循环",
            "一个引擎，它的 `has_unfinished_requests()` 从一开始就是 False（而且一直是 False）。",
        ),
        'raises RuntimeError naming the request id when the engine runs dry': (
            "引擎跑空时抛出 RuntimeError，写明请求 id",
            '请求 "mine" 得到一个 token，之后它还没完成，`has_unfinished_requests()` 就变成了 False。',
        ),
        'end to end: a real engine, another request finishing first': (
            "端到端：真实引擎，另一个请求先完成",
            (
                '一个每步预算 8 个 token 的真实引擎：先加入 "other"（3 个 token，生成 1 个），'
                '再加入 "by-hand"：20 个 token 的 prompt（贪心生成 6 个 token），它第二个 prefill chunk '
                "的那一步没有输出。"
            ),
        ),
    },
    "2.1": {
        "Q8_0: each number is d times its byte, read as a signed integer": (
            "Q8_0：每个数是 d 乘以它的字节，字节按有符号整数读",
            (
                "一个缩放为 0.5 的 Q8_0 block，32 个有符号字节是 -128 到 -8（步长 8），然后 -1、0、1，"
                "然后 7 到 117（步长 10），最后 127；以及一个缩放为 -0.25、装着 -3 到 28 的 block。"
            ),
        ),
        "Q4_0: low nibbles are numbers 0-15, high nibbles 16-31, each d * (q - 8)": (
            "Q4_0：低 4 位是第 0-15 个数，高 4 位是第 16-31 个数，每个是 d * (q - 8)",
            "两个 Q4_0 block（缩放 0.25 和 3.0），第 0..15 个数是 0..15（低 4 位），第 16..31 个数是 15..0（高 4 位）。",
        ),
        "Q4_1: d * q + m, the scale first and the minimum after it": (
            "Q4_1：d * q + m，缩放在前，最小值在后",
            "两个 Q4_1 block，先是缩放 0.5、最小值 -1.25，再是缩放 2.0、最小值 7.5，数和 Q4_0 的一样。",
        ),
        "whole matrices: [rows, row_bytes] uint8 -> [rows, cols] float32, block after block": (
            "整个矩阵：[rows, row_bytes] 的 uint8 -> [rows, cols] 的 float32，一个 block 接一个 block",
            "一个 [3, 96] 的矩阵，权重是固定种子的正态随机数，由 `gguf` 包量化成每种格式（3 行，每行 3 个 block）：返回的形状、dtype 和数。",
        ),
        "end to end: the tiny Llama from a Q4_1 GGUF, on the torch reference path": (
            "端到端：从 Q4_1 GGUF 加载的小 Llama，走 torch 参考路径",
            "评分器的小 Llama 写成 Q4_1 GGUF，加载时保留 block，在 torch 参考路径上运行，KV cache 64 个 block：四个 7 个 token 的 prompt，各贪心生成 8 个 token。",
        ),
    },
    "3.1": {
        'records each count under the request id': (
            "每个数都记在请求 id 名下",
            (
                '往一个 100 个 token 的计划里记四笔账："new"（7 个 token，`is_new=True`），'
                '然后是运行中的（`is_new=False`）"decode"（1 个）、"chunk"（30 个）和 "fits"（1 个）。'
            ),
        ),
        'pays each booking from token_budget': (
            "每次记账都从 token_budget 里扣",
            "同样的四笔账，以及每记一笔之后的 `token_budget`。",
        ),
        'a new request is filed as new, with no new_block_ids entry': (
            "新请求放进 new_reqs，new_block_ids 里没有它的条目",
            (
                "往一个空计划里 `add(new, 7, blocks [1, 2], is_new=True)`：worker 还没见过这个请求（它的 "
                "block 之后会随它一起完整地发过去）。"
            ),
        ),
        'a running request is filed as cached, with its new block ids': (
            "运行中的请求放进 cached_reqs，带上它的新 block id",
            (
                "往一个空计划里先 `add(decode, 1, blocks [5, 9], is_new=False)`，再 `add(fits, 1, no "
                "blocks, is_new=False)`（它的 token 放得进它已有的一个 block）。"
            ),
        ),
        'undo cancels what add booked': (
            "undo 撤销 add 记下的账",
            '记那四笔账，再对 "decode" 和 "fits" 各 `undo` 一次（就像它们在同一步里后来被抢占时那样）。',
        ),
        'end to end: chunked prefill under an 8-token budget': (
            "端到端：8 个 token 的预算下做 chunked prefill",
            (
                "四个各 7 个 token 的 prompt，预算 8 个 token：prefill 被切成 chunk，每个 prompt 贪心生成 8 "
                "个 token。"
            ),
        ),
    },
    "3.2": {
        'FCFS: the last request, whatever the priorities': (
            "FCFS：选最后一个请求，不管优先级",
            "FCFS 策略下，1 到 4 个运行中的请求，最后一个的 priority 值最小、到得最早。",
        ),
        'priority: the largest priority value': (
            "优先级策略：选 priority 值最大的",
            "PRIORITY 策略下，几个优先级各不相同的请求，最不重要的那个（值最大）既不在最后，也不是最晚到的。",
        ),
        'priority ties: the latest arrival': (
            "priority 相同：选到得最晚的",
            "PRIORITY 策略下，几个请求共有最大的 priority 值，到达的先后和它们的位置顺序不一致。",
        ),
        'full ties: the later position': (
            "完全平局：选位置靠后的",
            "PRIORITY 策略下，几个位置上的请求 `(priority, arrival_time)` 都相同。",
        ),
        'an empty list is a ValueError': (
            "空列表抛出 ValueError",
            "空的 `running` 列表，FCFS 和 PRIORITY 策略下各一次。",
        ),
        'end to end: preemption, FCFS': (
            "端到端：抢占，FCFS",
            (
                "四个各 7 个 token 的 prompt，每个贪心生成 16 个 token，只有 9 个可用 block，"
                "每个 block 4 个 token：FCFS 必须抢占。"
            ),
        ),
        'end to end: preemption, priority': (
            "端到端：抢占，优先级策略",
            "同样的四个 prompt 和同样吃紧的 KV cache，换成优先级策略（priority 分别为 3、0、2、1）。",
        ),
    },
    "4.1": {
        'returns only the new blocks, as a request grows': (
            "请求变长时，只返回新的 block",
            (
                "8 个空闲 block：先给 ``first``（10 个 token）的 prompt 分配槽位，再给一个 decode token（第 "
                "11 个，放得进第 3 个 block），再给另外两个（第 12、13 个，要用第 4 个 block）。"
            ),
        ),
        'cache hits are claimed before new blocks are taken, so none is evicted': (
            "先认领缓存命中，再拿新 block，哪个命中都不会被驱逐",
            (
                "5 个可用 block：``a``（8 个 token）和 ``b``（另外 8 个 token）占了 4 个 block 后完成，"
                "a 的两个已缓存的 block 就留在空闲 block 队列靠近队头的地方；然后 ``twin``（a 的 8 个 token "
                "再加 8 个）命中它们，再要 8 个新 token，也就是 2 个新 block。"
            ),
        ),
        'all or nothing: no room changes nothing (cache hits included), an exact fit is admitted': (
            "全有或全无：放不下就什么都不改（缓存命中也不动），正好放下的放进来",
            (
                "8 个可用 block；``huge`` 要 40 个 token（10 个 block）；然后 ``a``（8 个 token）"
                "跑完，它的 2 个已缓存的 block 在空闲 block 队列里等着（ref_cnt 0），``twin``（a 的 "
                "8 个 token 再加 52 个）命中它们，但一共要 15 个 block；最后 ``snug`` 要 32 个 token，"
                "正好是 8 个空闲 block。"
            ),
        ),
        'never more slots than max_model_len': (
            "槽位数绝不超过 max_model_len",
            (
                "max_model_len 为 8（2 个 block，每个 4 个 token）：先给 ``long``（8 个 token）"
                "的 prompt 分配槽位，再给第 9 个 token 分配，它会开出第 3 个 block。"
            ),
        ),
        'only tokens that exist are hashed into the prefix cache': (
            "只有已经存在的 token 才哈希进前缀缓存",
            (
                "``ahead`` 有 6 个 token（一个满的 block，加下一个 block 的一半），却要 8 个槽位，"
                "给还不存在的 token 留了位置；然后 ``probe`` 带着同样的 6 个 token 再加 4 个，"
                "在前缀缓存里查找自己。"
            ),
        ),
        'delay_cache_blocks keeps new blocks out of the prefix cache': (
            "delay_cache_blocks 让新 block 暂不进前缀缓存",
            (
                "以 delay_cache_blocks=True 给 ``loading``（8 个 token）分配槽位，就像 KV connector "
                "正在加载它的 block 时那样，``early``（同样的 8 个 token 再加 4 个）查找自己；"
                "然后不带这个延迟给 loading 的下一个 token 分配槽位，early 再查一次。"
            ),
        ),
        'with prefix caching off, nothing is cached': (
            "前缀缓存关着时，什么都不缓存",
            (
                "一个用 enable_caching=False 建的管理器给 ``plain``（8 个 token，它的 2 个满 block "
                "都有哈希）分配全部 8 个槽位。"
            ),
        ),
        'num_new_tokens < 1 is a ValueError': (
            "num_new_tokens < 1 时抛出 ValueError",
            "``r``（3 个 token）先要 0 个新 token，再要 -1 个。",
        ),
        **_KV_CACHE_END_TO_END,
    },
    "4.2": {
        'returns the SHA-256 digest as 32 bytes': (
            "返回 32 字节的 SHA-256 摘要",
            "一个 prompt 的第一个 block，token 为 [1, 2, 3, 4]，没有父 block（None）。",
        ),
        "chained: the parent's hash changes the result": (
            "链式：父 block 的哈希会改变结果",
            (
                "token [5, 6, 7, 8] 接在 block [1, 2, 3, 4] 后面算一次哈希，再作为第一个 block 算一次；"
                "同一个调用做两遍。"
            ),
        ),
        'the first block (parent None) is chained on NONE_HASH': (
            "第一个 block（父 block 为 None）接在 NONE_HASH 后面",
            "token [1, 2, 3, 4]，父 block 分别为 None 和 NONE_HASH。",
        ),
        'exact values: token ids packed as signed 64-bit little-endian': (
            "确切的值：token id 打包成有符号、小端序的 64 位整数",
            (
                "三个 block 连成的链：[1, 2, 3, 4]，然后 [5, 6, 7, 8]，再是超出 32 位的 token id [2**40, 0, "
                "7, 2**31]；每个哈希都以十六进制显示。"
            ),
        ),
        "end to end: prefix cache": _KV_CACHE_END_TO_END["end to end: prefix cache"],
    },
    "4.3": {
        'unlinks from the middle, the head and the tail, both directions': (
            "从中间、队头和队尾摘下，两个方向都接好",
            (
                "由 block [0, 1, 2, 3, 4, 5] 组成的队列：依次摘掉 block 2（中间）、0（队头）和 5（队尾），"
                "每摘一个都把链表正反各走一遍；然后 popleft()，再 append(block 2)。"
            ),
        ),
        'keeps num_free_blocks right': (
            "num_free_blocks 保持正确",
            (
                "由 block [0, 1, 2, 3, 4, 5] 组成的队列（6 个空闲）：摘掉 block 2、0 和 5，然后 popleft()，"
                "再 append(block 2)，每做一步都读一次 num_free_blocks。"
            ),
        ),
        "clears the removed block's pointers": (
            "清掉摘下来的 block 的指针",
            (
                "由 block [0, 1, 2, 3, 4, 5] 组成的队列：摘掉 block 2、0 和 5，读出每个摘下来的 block 的 "
                "(prev_free_block, next_free_block)，以 block id 表示（或者是哪个哨兵节点）。"
            ),
        ),
        'a block not in the queue is a RuntimeError, and nothing changes': (
            "block 不在队列里时抛出 RuntimeError，什么都不改",
            (
                "由 block [0, 1, 2, 3, 4, 5] 组成、但没有 block 2 的队列：再摘一次 block 2，"
                "然后摘一个从没进过队列的 block 9；队列必须保持原样。"
            ),
        ),
        **_KV_CACHE_END_TO_END,
    },
    "4.4": {
        'a new request: attention blocks plus one block per state group, whatever its length': (
            "新请求：注意力 block，加上每个状态组一个 block，不管它多长",
            (
                "一个注意力组（每个 block 4 个 token）和两个状态组，共用一个有 29 个可用 block 的 block pool："
                "请求 ``new`` 还什么都没持有，长度分别为 1、4、5、17 和 64（max_model_len）个 token，"
                "没有缓存命中。"
            ),
        ),
        'a running request: no more state blocks, one attention block per block_size tokens': (
            "运行中的请求：不再要状态 block，每 block_size 个 token 一个注意力 block",
            (
                "同样的几个组：``run`` 持有 5 个 token 的 block（2 个注意力 block，每个状态组一个 block）；"
                "然后要让它一共装下 5、8、9、13 和 64 个 token。"
            ),
        ),
        'cache hits: an evictable hit (ref_cnt 0) takes a free block, a held hit none': (
            "缓存命中：可驱逐的命中（ref_cnt 0）占一个空闲 block，有人持有的命中不占",
            (
                "一个组，每个 block 4 个 token，开着前缀缓存，9 个可用 block：``held``（token 1-8）"
                "留着它的 2 个已缓存 block；``gone``（token 100-107）缓存了 2 个 block 后完成，这两个 block "
                "就在空闲 block 队列里等着（ref_cnt 0）；带着同样 8 个 token 再加 8 个的请求命中这些 block，"
                "分别数 8 个和 16 个 token 要多少 block。"
            ),
        ),
        'all or nothing across groups: short of blocks, no group gets one; an exact fit is admitted': (
            "全有或全无，所有组一起算：block 不够，哪个组都拿不到；正好放下的放进来",
            (
                "在同样的几个组上调用 ``allocate_slots``，7 个可用 block：先是 ``a``（8 个 token：2 + 1 + "
                "1 个 block），然后 ``b``（5 个 token：2 + 1 + 1，这时空闲 3 个），然后 ``c``（1 个 token："
                "1 + 1 + 1，正好是空闲的 3 个），最后是 a 的第 9 个 token（再要 1 个注意力 block，"
                "已经没有空闲的）。"
            ),
        ),
        'end to end: greedy tokens on a tiny hybrid model': (
            "端到端：小混合模型上贪心生成的 token",
            (
                "评分器自带的小 Qwen3.5（一个注意力组，三个状态组），不管评分器拿到的是什么模型："
                "四个各 7 个 token 的 prompt，每个贪心生成 8 个 token，64 个 block，每个 16 个 token。"
            ),
        ),
        'end to end: preemption on a tiny hybrid model': (
            "端到端：小混合模型上的抢占",
            (
                "这个小 Qwen3.5：四个各 7 个 token 的 prompt，每个贪心生成 16 个 token，"
                "只有 9 个可用 block，每个 16 个 token；一个请求持有 1 个注意力 block 和 3 个状态 block，"
                "超过 16 个 token 后是 5 个，所以调度器必须抢占。"
            ),
        ),
    },
    "4.5": {
        'no state: the requested block size is kept': (
            "没有状态：保留要求的 block size",
            "state_bytes 为 0（没有状态层），要求的 block size 分别是 4、16 和 7。",
        ),
        "exact fit: K and V of the block take exactly the state's bytes": (
            "正好装下：block 的 K 和 V 正好占状态的字节数",
            (
                "状态正好是 16、32 和 48 个 token 的 K 和 V 那么大（每个 token 512 字节时是 8192 和 16384 "
                "字节，64 字节时是 3072），要求的 block size 分别是 16、4 和 1。"
            ),
        ),
        "rounds up: a state a byte short of 16 tokens' K and V takes those 16 tokens": (
            "向上取整：状态比 16 个 token 的 K 和 V 少一个字节，也要占这 16 个 token",
            (
                "状态比 16、32 和 48 个 token 的 K 和 V 少一个字节（8191、16383 和 3071 字节），"
                "要求的 block size 分别是 16、4 和 1。"
            ),
        ),
        'one byte over takes 16 more tokens: always a multiple of 16, even if fewer would do': (
            "多一个字节就多要 16 个 token：总是 16 的倍数，哪怕更少就够",
            (
                "状态比 16 和 32 个 token 的 K 和 V 多一个字节（每个 token 512 字节时是 8193、"
                "16385 字节），小 Qwen3.5 的 5632 字节状态（每个 token 512 字节时是 11 个 token），"
                "以及每个 token 64 字节时的 1025 字节（17 个 token），要求的 block size 分别是 16、4、4 和 1。"
            ),
        ),
        'a larger requested block size is kept as it is': (
            "要求的 block size 更大时，原样保留",
            (
                "16 个 token 就装得下的状态，要求 32 和 40；正好 32 个 token 装得下的状态，要求 32；"
                "Qwen3.5-0.8B 的 fp32 状态（288 个 token 就够），要求 512。"
            ),
        ),
        'Qwen3.5-0.8B: 4096 bytes of K/V a token in fp32, its state -> 288 tokens': (
            "Qwen3.5-0.8B：fp32 下每个 token 4096 字节的 K/V，它的状态 -> 288 个 token",
            (
                "Qwen3.5-0.8B 的各层（nanoengine 自带的配置），要求 block size 16，fp32 和 bf16 各一次，"
                "由 ``group_kv_cache_layers`` 分组（它会调用 ``align_hybrid_block_size``）。"
            ),
        ),
        "end to end: a tiny hybrid model's 4-token blocks are raised to 16": (
            "端到端：小混合模型 4 个 token 的 block 调大到 16 个",
            (
                "评分器自带的小 Qwen3.5（每个 token 512 字节的 K/V，状态 5632 字节），"
                "不管评分器拿到的是什么模型，要的是 4 个 token 的 block 和 1 MiB 的 KV cache："
                "四个各 7 个 token 的 prompt，每个贪心生成 8 个 token。"
            ),
        ),
    },
    "4.6": {
        "the table keeps its length: the null block in place of each given-back block": (
            "block table 长度不变：每个还回去的 block 的位置换成 null block",
            (
                "窗口 8，每个 block 4 个 token：在有 10 个 block 的 block table 上调用 "
                "remove_skipped_blocks(\"r\", 19)，跳过 12 个 token（整 3 个 block）；看调用之后的 block table。"
            ),
        ),
        "the given-back blocks go to the pool, the latest in the table first": (
            "还回去的 block 进 block pool，block table 里靠后的先还",
            "同样在 19 个 token 处调用：block pool 里空闲 block 的个数，以及空闲 block 队列最后三项（block 还回去的顺序）。",
        ),
        "keeps the block that holds the window's first key": (
            "留着窗口第一个 key 所在的 block",
            (
                "每次用一张新的 10 个 block 的 block table，分别在 22、23、24 个 token 处调用一次："
                "跳过 15、16、17 个 token，所以下一个 token 读的第一个 key 是 15、16、17。"
            ),
        ),
        "a later call gives back only the newly skipped blocks; no blocks, no change": (
            "之后的调用只还新跳过的 block；没有 block 时什么都不变",
            (
                "在同一张 block table 上依次在 19、再 19、27、30 个 token 处调用（请求在变长），"
                "然后对还没有 block 的请求 \"x\" 调用一次：每次之后的 block table 和空闲 block 数。"
            ),
        ),
        "full attention skips nothing: get_num_skipped_tokens decides": (
            "全注意力什么都不跳过：由 get_num_skipped_tokens 决定",
            "一个全注意力管理器（没有窗口），block table 相同：在 19 和 40 个 token 处调用；之后的 block table 和空闲 block 数。",
        ),
        "end to end: greedy tokens and preemptions on a tiny sliding-window model": (
            "端到端：小滑动窗口模型上的贪心 token 和抢占",
            (
                "评分器自带的小 Gemma 3（三个窗口为 16 个 token 的局部层，一个全局层），不管给的是什么模型："
                "四个各 7 个 token 的 prompt，每个贪心生成 40 个 token，63 个可用 block，每个 4 个 token。"
                "从不还 block 的滑动窗口组占得更多，调度器就得更常抢占。"
            ),
        ),
    },
    "5.1": {
        'every FINISHED_* state is finished': (
            "每个 FINISHED_* 状态都算结束",
            "对六个 `FINISHED_*` 状态逐个调用 `RequestStatus.is_finished(status)`。",
        ),
        'WAITING*, RUNNING and PREEMPTED are not finished': (
            "WAITING*、RUNNING 和 PREEMPTED 都不算结束",
            (
                "对 `WAITING`、三个 `WAITING_FOR_*` 状态、`RUNNING` 和 `PREEMPTED` 调用 "
                "`RequestStatus.is_finished(status)`。"
            ),
        ),
        'end to end: generation with an abort': (
            "端到端：生成时中止一个请求",
            "在两个运行中的请求里中止一个；另一个必须跑完，结果不受影响。",
        ),
    },
    "5.2": {
        'WAITING and PREEMPTED pass unchanged': (
            "WAITING 和 PREEMPTED 直接通过，状态不变",
            "一个 `WAITING` 请求和一个 `PREEMPTED` 请求（被抢占过一次）。",
        ),
        'grammar still compiling: not ready': (
            "文法还在编译：没有就绪",
            "一个 `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR` 请求，它的文法 `Future` 还没完成。",
        ),
        'grammar compiled: promoted': (
            "文法编译完成：提升",
            (
                "一个 `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR` 请求，它的文法 `Future` 已经 "
                "`set_result`（从没被抢占过）。"
            ),
        ),
        'grammar failed: FINISHED_ERROR, its message, False': (
            "文法编译失败：FINISHED_ERROR，带上错误消息，返回 False",
            (
                "一个 `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR` 请求，它的文法 `Future` 已经 "
                '`set_exception(ValueError("bad grammar"))`。'
            ),
        ),
        'remote KVs not loaded: not ready, set untouched': (
            "远端 KV 还没加载完：没有就绪，集合不动",
            (
                '一个 `WAITING_FOR_REMOTE_KVS` 请求 "mine"，先是 `self.finished_recving_kv_req_ids` 为空时，'
                '再是集合里只有 `"other"` 时。'
            ),
        ),
        'remote KVs loaded: promoted, only its id removed': (
            "远端 KV 加载完：提升，只去掉它自己的 id",
            (
                '一个 `WAITING_FOR_REMOTE_KVS` 请求 "mine"，这时 `self.finished_recving_kv_req_ids` 是 '
                '`{"mine", "other"}`（从没被抢占过）。'
            ),
        ),
        'stream with nothing new to prefill: not ready': (
            "流式 prompt 没有新的 token 可以 prefill：没有就绪",
            (
                "一个还没关闭的 `WAITING_FOR_STREAMING_REQ` 流，prompt 有 6 个 token，已经算过 5 个："
                "它扣下最后一个 token，所以能 prefill 的是 5 个，没有新的可以 prefill。"
            ),
        ),
        'stream with more to prefill: promoted': (
            "流式 prompt 有更多 token 可以 prefill：提升",
            (
                "同一个流，又来了 1 个 prompt token 之后（6 个能 prefill）；以及不加 token、"
                "改为关闭它的输入之后（扣下的 token 放出来：6 个能 prefill）。"
            ),
        ),
        'promoted to PREEMPTED if ever preempted, else WAITING': (
            "被抢占过就提升回 PREEMPTED，否则回 WAITING",
            "三种阻塞状态，每种都已就绪，`num_preemptions` 分别为 0、1 和 2。",
        ),
        'end to end: a prompt streamed in three pieces': (
            "端到端：一个分三段流式发送的 prompt",
            "一个 prompt 分三段发出去，旁边还有一个普通请求。",
        ),
    },
    "6.1": {
        'blocks from a byte budget: one block is spec.page_size_bytes (K and V, every layer)': (
            "从字节预算算 block 数：一个 block 占 spec.page_size_bytes（K 和 V，每一层）",
            (
                "预算正好是 1、3 和 1000 个 block 的 `page_size_bytes`，三种 spec 的 block size、层数、"
                "KV 头数、head size 和元素大小各不相同。"
            ),
        ),
        'a partial block does not count (floor, not ceil)': (
            "不完整的 block 不算（向下取整，不是向上取整）",
            "同样三种 spec，预算比 1 个和 3 个 block 少一个字节，以及 2.5 个 block、10 个 block 加 7 字节。",
        ),
        'a zero or negative budget fits no block (0, not negative)': (
            "预算为零或为负时一个 block 也放不下（返回 0，不是负数）",
            "同样三种 spec，预算为 0、-1 和 -5 字节，以及负 3 个 block 的字节数。",
        ),
        'end to end: KV cache sized from a byte budget': (
            "端到端：按字节预算定 KV cache 的大小",
            (
                "用 `kv_cache_memory_bytes=6_000_000`、`max_model_len=64`、每个 block 4 个 token "
                "建一个引擎（在小测试模型上是几千个 block，在 SmolLM2 上是 32 个），然后为四个 prompt "
                "各贪心生成 8 个 token。"
            ),
        ),
    },
    "6.2": {
        'q: rank r takes query heads [r * num_heads, (r + 1) * num_heads), whole rows': (
            "q：rank r 拿 query 头 [r * num_heads, (r + 1) * num_heads) 的整行",
            (
                "只加载 ``q_proj``（8 个头，每个 2 行，隐藏层大小 8），在 2、4 和 8 个 rank 的每个 rank "
                "上各做一次；按头读回融合权重。"
            ),
        ),
        "[q | k | v]: q at row 0, k after this rank's q rows, v after its k rows, nothing else written": (
            "[q | k | v]：q 从第 0 行开始，k 接在这个 rank 的 q 行后面，v 接在它的 k 行后面，别的什么都不写",
            (
                "2 个 KV 头时 1 个和 2 个 rank 的每个 rank，以及 4 个 KV 头时 2 个 rank 中的 rank 1："
                "``q_proj``、``k_proj`` 和 ``v_proj`` 各自单独加载，再三个一起加载（按 q、k、v 和 v、k、"
                "q 两种顺序）；每个头的那几行按它们来自哪个投影显示。"
            ),
        ),
        'one rank: every head of q, k and v': (
            "只有一个 rank：q、k、v 的每个头",
            "一个 rank（张量并行大小 1），KV 头分别为 8、2 和 1 个：加载 q、k 和 v。",
        ),
        'k and v split like q when there are at least as many KV heads as ranks': (
            "KV 头不比 rank 少时，k 和 v 像 q 一样切分",
            (
                "2 个 KV 头分到 2 个 rank，4 个分到 2 个和 4 个 rank，8 个分到 4 个 rank："
                "在每个 rank 上加载 q、k 和 v。"
            ),
        ),
        'fewer KV heads than ranks: rank r takes KV head r * total_num_kv_heads // tp_size': (
            "KV 头比 rank 少：rank r 拿第 r * total_num_kv_heads // tp_size 个 KV 头",
            (
                "KV 头比 rank 少：2 个分到 4 个和 8 个 rank，1 个分到 2 个和 4 个：在每个 rank 上加载 q、"
                "k 和 v。"
            ),
        ),
        'the bias is split and placed like the weight': (
            "偏置和权重一样切、一样放",
            (
                "q、k 和 v 的偏置（``k_proj`` 偏置的第 i 行存的是 2000 + i），分别在 1 个 rank、"
                "2 个 rank（2 个 KV 头，切分）和 4 个 rank（2 个 KV 头，复制）上加载。"
            ),
        ),
        'a tensor of the wrong shape: ValueError naming both shapes, nothing copied': (
            "形状不对的张量：抛出 ValueError，写明两个形状，什么都不复制",
            (
                "本该是 (4, 8) 的地方给了 ``q_proj`` 形状 (16, 8) 的 ``k_proj``、"
                "转置成 (8, 16) 的 ``q_proj``、隐藏层大小为 7 的 ``v_proj``、15 行的 ``q_proj`` 偏置，"
                "以及当作权重传入的 ``q_proj`` 偏置；2 个 KV 头，在 1 个和 2 个 rank 的设置下。"
            ),
        ),
        'an unknown shard id: ValueError, nothing copied': (
            "不认识的 shard id：抛出 ValueError，什么都不复制",
            (
                '以 shard id "o"（o_proj 的名字）、0（gate_up_proj 的第一个 shard）和 None 加载 ``k_proj`` '
                "的完整权重（k 和 v 该有的形状），2 个 rank 中的 rank 0，2 个 KV 头。"
            ),
        ),
        "end to end: two ranks of a tiny Llama give Hugging Face's logits": (
            "端到端：小 Llama 的两个 rank 算出和 Hugging Face 一样的 logits",
            (
                "评分器自带的两个小 Llama（4 个 query 头，每个 16 维；先是 2 个 KV 头，"
                "再是 1 个），不管评分器拿到的是什么模型，跑在 2 个 gloo rank 上："
                "每个 rank 通过你的加载函数加载自己的切片，对四个各 7 个 token 的 prompt 做 prefill；"
                "拿它的 logits 和 Hugging Face 的比。"
            ),
        ),
        'end to end: greedy tokens through LLM at one rank': (
            "端到端：单个 rank 的 LLM 贪心生成的 token",
            (
                "张量并行大小为 1 的 ``LLM``，跑评分器拿到的模型（你的加载函数加载每一个头）："
                "四个各 7 个 token 的 prompt，每个贪心生成 8 个 token，64 个 block，每个 4 个 token。"
            ),
        ),
    },
    "7.1": {
        'returns int64 of shape [num_tokens]': (
            "返回形状为 [num_tokens] 的 int64",
            (
                "两个请求，block table 为 `[[3, 8], [5, 1]]`（`int32`），每个 block 4 个 token："
                "先是 6 个 token，再是 1 个。"
            ),
        ),
        'slot = block_id * block_size + position % block_size': (
            "槽位 = block_id * block_size + position % block_size",
            (
                "一个请求，block table 为 `[[7, 3, 12]]`，位置 0 到 11，每个 block 4 个 token；"
                "再用 `[[7, 3, 12, 2, 9, 4, 11, 6, 10, 5, 8, 1]]`，位置 0 到 11，每个 block 1 个 token。"
            ),
        ),
        "each token reads its own request's row of the block table": (
            "每个 token 读 block table 里它自己请求的那一行",
            (
                "三个请求，block table 为 `[[4, 9], [6, 2], [11, 13]]`，每个 block 2 个 token；"
                "它们的 token 交错排列：请求 2 在位置 3 和 0，请求 0 在位置 1，请求 1 在位置 2 和 0。"
            ),
        ),
        'slots of random block tables': (
            "随机 block table 的槽位",
            (
                "随机的 block table，3 个请求 x 4 个互不相同的 block id（1-63），10 个 token "
                "落在随机的行和位置上，block size 分别为 1、4 和 16（固定了随机种子：每次运行都一样）。"
            ),
        ),
        'no int32 overflow: slots past the largest int32': (
            "不能有 int32 溢出：槽位超过 int32 的最大值",
            (
                "一张存着 block id `2**27 + 5` 的 block table（`int32`），每个 block 16 个 token："
                "槽位超过了 `int32` 的最大值 `2**31 - 1`。"
            ),
        ),
        'end to end: several requests, 4-token blocks': (
            "端到端：几个请求，每个 block 4 个 token",
            "四个各 7 个 token 的 prompt，每个贪心生成 8 个 token，64 个 block，每个 4 个 token。",
        ),
    },
    "8.1": {
        'returns the batch in the queue': (
            "返回队列里的批次",
            "队列里有一个批次（请求 'a' 的）；引擎活着。",
        ),
        'returns the batches in the order they were queued': (
            "按入队的顺序返回批次",
            "队列里依次是 'a'、'b' 和 'c' 的三个批次；调用三次。",
        ),
        'waits for a batch that arrives during the wait': (
            "等待期间才到的批次也要等到",
            "队列是空的；调用开始 0.05 s 后，'late' 的一个批次放进队列。",
        ),
        'nothing within the wait: an empty EngineCoreOutputs, not None, not a hang': (
            "等待期间什么都没等到：返回空的 EngineCoreOutputs，不是 None，也不卡住",
            "队列是空的，而且一直空着；引擎活着。",
        ),
        'raises the EngineDeadError that comes out of the queue': (
            "从队列里取出 EngineDeadError，就抛出它",
            "队列里是监控线程放进去的 EngineDeadError（``_dead`` 就是这个错误）。",
        ),
        'dead and nothing queued: raises self._dead after the wait': (
            "引擎已死、队列里什么都没有：等待之后抛出 self._dead",
            "队列是空的，``_dead`` 已经设置：之前的某次调用已经把错误从队列里取走了。",
        ),
        'the batches queued before the death come out before the error': (
            "引擎死之前入队的批次，先于错误出来",
            "队列里先是 'a' 的一个批次，然后是 EngineDeadError（``_dead`` 就是这个错误）；调用两次。",
        ),
        'end to end: LLM(multiprocess_mode=True), then a killed core': (
            "端到端：LLM(multiprocess_mode=True)，然后杀掉引擎核心",
            (
                "``LLM(model, multiprocess_mode=True)`` 为四个 prompt 各贪心生成 8 个 token；"
                "然后再加一个请求，杀掉引擎核心进程（SIGKILL），反复调用 ``engine.step()``，"
                "直到它抛出异常（最多 10 s）。"
            ),
        ),
    },
    "8.2": {
        "each output goes to its own request's queue": (
            "每个输出都送进它所属请求的队列",
            (
                "'a'、'b'、'c' 各有一个队列；三个批次：[a 1, b 2]，然后 [c 3, a 4]，然后 [b 5, finished]；"
                "之后客户端一直等下一批。"
            ),
        ),
        'an output with no queue (consumer gone) is skipped': (
            "没有队列的输出（消费者已经走了）直接跳过",
            (
                "只有 'a' 有队列；两个批次：[gone 1, a 2]，然后 [gone 3, finished; a 4]，"
                "其中 'gone' 没有队列（它的消费者已经走了）；之后客户端一直等下一批。"
            ),
        ),
        'requests that hit a stop string are aborted in the core': (
            "碰到停止字符串的请求要在引擎核心里中止",
            (
                "'a' 和 'b' 各有一个队列；两个批次：[a 1, b 2]，其中 'b' "
                "碰到停止字符串（输出处理器让它完成，并把它列进 ``reqs_to_abort``），然后是 [a 3]。"
            ),
        ),
        'every finished output goes to every finished listener, once': (
            "每个已完成的输出都交给每个完成监听器，各一次",
            (
                "'a' 和 'b' 各有一个队列，两个完成监听器；三个批次：[a 1, b 2]，然后 [a 3, finished; b 4]，"
                "然后 [b 5, finished; gone 6, finished]（'gone' 没有队列）。"
            ),
        ),
        'an exception sets dead_error and reaches every waiting request': (
            "异常要记进 dead_error，并送到每个正在等的请求",
            (
                "'a'、'b'、'c' 各有一个队列：一个批次 [a 1]，然后客户端抛出 EngineDeadError；再从头来一次，"
                "'a' 和 'b' 各有一个队列：两个批次 [a 1] 和 [b 2]，process_outputs 在第二个上抛出 "
                "ValueError。"
            ),
        ),
        'cancelled (shutdown) is no death: the task ends, no request is told': (
            "取消（shutdown）不是死亡：任务结束，不通知任何请求",
            (
                "'a' 和 'b' 各有一个队列；一个批次 [a 1]；然后趁输出处理任务等下一批时，"
                "像 ``AsyncLLM.shutdown`` 那样取消这个任务。"
            ),
        ),
        'end to end: AsyncLLM streams concurrent requests, and a stop string': (
            "端到端：AsyncLLM 同时流式返回多个请求，外加一个停止字符串",
            (
                "一个 ``AsyncLLM`` 同时流式跑四个贪心请求（每个 8 个 token，"
                "注册了一个完成监听器）；然后发一个请求，prompt 和第一个请求相同，"
                "停止字符串取自第一个请求的文本（文本中间的两个字母或数字），旁边还有一个普通请求。"
            ),
        ),
    },
    "9.1": {
        'returns a list of Python ints': (
            "返回 Python int 的列表",
            (
                "草稿 `[4, 9]`，各行的 argmax 先是 `[4, 9, 2]`（两个都留下），再是 `[4, 5, "
                "2]`（`d_1` 被拒绝）：结果的类型，以及结果里每个 token 的类型。"
            ),
        ),
        "a rejected draft: the target's token takes its place, and the step ends there": (
            "草稿被拒绝：目标模型的 token 顶替它，这一步到此结束",
            (
                "草稿 `[3, 8]` 对 argmax `[5, 6, 1]`，`[7, 7, 7]` 对 `[2, 9, 9, 9]`（`d_0` 就错了）；"
                "`[4, 4, 3]` 对 `[4, 4, 4, 6]`（`d_2` 错了）。"
            ),
        ),
        'draft d_j is judged by row j, not row j + 1': (
            "草稿 d_j 由第 j 行来判，不是第 j + 1 行",
            (
                "草稿 `[5, 9]` 对 argmax `[4, 5, 9]`，`[4, 9]` 对 `[4, 5, 9]`，`[6]` 对 `[2, 6]`："
                "在自己那一行错了的草稿，正好是下一行的 argmax。"
            ),
        ),
        'only the matching prefix is kept: a later draft that matches does not count': (
            "只留下对得上的前缀：后面的草稿对上了也不算",
            (
                "草稿 `[3, 5, 8]` 对 argmax `[3, 6, 8, 2]`，`[1, 2, 3, 4]` 对 `[9, 2, 3, 4, 5]`："
                "第一个错的草稿后面，那些草稿都和自己那一行对得上。"
            ),
        ),
        'every draft kept: the drafts, then the bonus token of the last row': (
            "草稿全部留下：先是这些草稿，再是最后一行的 bonus token",
            "草稿 `[4, 9, 2]` 对 argmax `[4, 9, 2, 6]`，`[11]` 对 `[11, 3]`：每个草稿都是目标模型会选的。",
        ),
        "no drafts: the target's own token alone": (
            "没有草稿：只有目标模型自己的 token",
            "没有草稿（`[]`），只有一行分数，它的 argmax 先是 `7`，再是 `0`。",
        ),
        "a tie goes to the lowest token id, as the sampler's argmax": (
            "平局时取最小的 token id，和采样器的 argmax 一样",
            (
                "第 0 行给 token `2` 和 `5` 相同的最高分（第 1 行的 argmax 是 `7`）：草稿先是 `[5]`，"
                "再是 `[2]`；第 1 行给 token `3` 和 `12` 相同的最高分，前面的草稿 `[9]` 已经留下："
                "草稿 `[9, 12]`。"
            ),
        ),
        'random batches of drafts, through rejection_sample': (
            "批量随机草稿，经过 rejection_sample",
            (
                "12 个 batch，每个 3 个请求，每个请求 0 到 4 个草稿，经过 `rejection_sample(drafts, "
                "scores, greedy=[True] * 3)`：每个草稿以 0.7 的概率是它那一行的 argmax，一个 batch "
                "的分数是一个形状为 `[sum(k_i + 1), 16]` 的浮点张量（固定了随机种子：每次运行都一样）。"
            ),
        ),
        'end to end: n-gram drafts give the tokens of plain greedy decoding': (
            "端到端：n-gram 草稿给出的 token 和普通贪心解码一样",
            (
                "四个由同一个 token 重复组成的 prompt（`[160] * 3`、`[230] * 3`、`[40] * 3`、`[280] * 3`）"
                "，每个贪心生成 24 个 token，用最多 3 个 token 的 n-gram 草稿（`prompt_lookup_min=1`，"
                "`prompt_lookup_max=3`）；再不做投机，同样跑一遍。"
            ),
        ),
    },
    "10.1": {
        "no local hits: every block the remote tokens fill is pulled": (
            "没有本地命中：远端 token 占到的每个 block 都要拉",
            (
                "decode 引擎的前缀缓存里什么都没有：13 个 token 的 prompt，connector 报了 12 个远端 token"
                "（block 0-2 装它们，block 3 只装最后一个 prompt token）；9 个 token 的 prompt，报了 8 个。"
            ),
        ),
        "local prefix-cache hits stay home: only the blocks after them are pulled": (
            "本地前缀缓存命中的留在本地：只拉它们后面的 block",
            "前 2 个或 3 个 block 是前缀缓存命中：17 个 token 的 prompt，命中 8 个 token 时报 8 个远端 token，命中 12 个时报 4 个。",
        ),
        "a block the remote tokens fill only in part is pulled too (round up)": (
            "远端 token 只占了一部分的 block 也要拉（向上取整）",
            (
                "远端 token 在一个 block 中间结束：11 个 token 的 prompt 报 10 个（block 2 里有 2 个），"
                "命中 4 个 token 的 15 个 token 的 prompt 报 10 个，6 个 token 的 prompt 报 5 个。"
            ),
        ),
        "nothing to pull: one plan with no blocks, so the producer frees them": (
            "没有要拉的：一份不带 block 的计划，让 prefill 引擎释放它们",
            "报了 0 个远端 token（除最后一个以外，prompt 的每个 block 都命中了），按调度器这时的调用方式：没有 block id，0 个外部 token。",
        ),
        "once only: do_remote_prefill is cleared, a second call plans nothing": (
            "只拉一次：清掉 do_remote_prefill，第二次调用不再安排",
            "13 个 token 的 prompt 报了 12 个远端 token，函数调用两次（就像第二次接纳那样）：每次之后的计划数，以及第一次之后的 `do_remote_prefill`。",
        ),
        "a request that is not to be pulled is left alone": (
            "不该拉的请求，原样不动",
            "不该拉的请求：没有 kv_transfer_params、prefill 那边的请求（`do_remote_decode`）、`do_remote_prefill: false`；计划数，以及调用后的参数。",
        ),
        "the plan names the producer's request, engine, host and port": (
            "计划写明 prefill 引擎上的请求、引擎、主机和端口",
            "13 个 token 的 prompt 报了 12 个远端 token：计划从谁那里、从哪里读 block。",
        ),
        "end to end: KV from a producer engine gives a consumer one engine's tokens": (
            "端到端：用 prefill 引擎送来的 KV，decode 引擎给出和单个引擎一样的 token",
            (
                "同一个进程里、评分器自带的小 Llama 上一个 prefill 引擎和一个 decode 引擎，block 4 个 token，fp32：两个 30 个 token 的 "
                "prompt（第二个和第一个共用 16 个 token）在 prefill 引擎上 prefill，在 decode 引擎上 decode "
                "8 个 token；得到的 token、从 prefill 引擎拉来的 token 数，以及和单个引擎的 token 比较。"
            ),
        ),
    },
}

"""Built-in chat conversations for the `chat` dataset: short multi-turn conversations about
varied topics, each ending with a user turn, with the length in tokens of the answer a real
assistant would give it (the request's max_tokens). User turns run from about 10 to 300 words,
as in real chat traffic: quick questions, follow-ups, and pasted code, notes or drafts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Conversation:
    topic: str
    turns: tuple[str, ...]  # user, assistant, user, ..., ending with the user turn to answer
    output_len: int  # tokens of the answer to the last turn


CONVERSATIONS: tuple[Conversation, ...] = (
    Conversation(
        topic="python csv grouping",
        turns=(
            (
                "I have a CSV of sales with columns date, region, product and amount. I want the "
                "total amount per region per month. Here is what I have so far:\n"
                "\n"
                "import csv\n"
                "from collections import defaultdict\n"
                "\n"
                "totals = defaultdict(float)\n"
                'with open("sales.csv") as f:\n'
                "    for row in csv.DictReader(f):\n"
                '        month = row["date"][:7]\n'
                '        totals[(row["region"], month)] += row["amount"]\n'
                "\n"
                "print(totals)\n"
                "\n"
                "It crashes with a TypeError. What am I doing wrong?"
            ),
            (
                'The error comes from `row["amount"]`: csv.DictReader gives you every field as '
                'a string, so `totals[...] += row["amount"]` tries to add a str to a float. '
                "Convert it first:\n"
                "\n"
                'totals[(row["region"], month)] += float(row["amount"])\n'
                "\n"
                'Two more things worth checking. First, `row["date"][:7]` only gives you '
                '"YYYY-MM" if every date is written as ISO (2024-03-17); if some rows use '
                "17/03/2024 you will get nonsense keys, so parse the date with datetime.strptime "
                "if the format is not guaranteed. Second, if the amounts contain thousands "
                'separators like "1,200.50", float() will fail on them, and you will need to '
                "strip the commas first."
            ),
            (
                "That fixed it, thanks. Now I would like to print it as a table sorted by region "
                "and then by month, and also write it to a new CSV. Would pandas make this "
                "easier, or should I stay with the standard library?"
            ),
        ),
        output_len=320,
    ),
    Conversation(
        topic="japan itinerary",
        turns=(
            (
                "My partner and I are going to Japan for the first time in April, 9 days total. "
                "We land in Tokyo and fly out of Osaka. We like food, old temples, and walking "
                "around neighborhoods more than big tourist attractions. Can you suggest a rough "
                "plan?"
            ),
            (
                "April is cherry blossom season, so expect crowds and book hotels early. With 9 "
                "days, Tokyo in, Osaka out, a good split is 4 nights in Tokyo, 3 in Kyoto and 2 "
                "in Osaka.\n"
                "\n"
                "Tokyo (days 1-4): Yanaka and Nezu for old wooden houses and small temples, "
                "Asakusa early in the morning before the crowds, Shimokitazawa and Koenji for "
                "cafes and vintage shops, and an evening in the alleys of Omoide Yokocho. A day "
                "trip to Kamakura gives you temples by the sea.\n"
                "\n"
                "Kyoto (days 5-7): walk the Philosopher's Path, visit Fushimi Inari at dawn, "
                "spend an afternoon in the quieter northern temples like Daitoku-ji, and eat "
                "your way through Nishiki Market.\n"
                "\n"
                "Osaka (days 8-9): Dotonbori and Shinsekai for street food, and a half day in "
                "Nara for the deer and Todai-ji."
            ),
            (
                "This looks great. Is the Japan Rail Pass still worth it for this route? And how "
                "should we handle luggage between cities, since we don't want to drag two big "
                "suitcases onto the shinkansen?"
            ),
            (
                "Since the price increase in late 2023 the 7-day pass usually does not pay off "
                "for a Tokyo to Kyoto to Osaka trip. A single Tokyo to Kyoto shinkansen ticket "
                "is around 14,000 yen, and Kyoto to Osaka is cheap on local trains, so buying "
                "point-to-point tickets is simpler and cheaper. Get a Suica or ICOCA card for "
                "the subways and buses.\n"
                "\n"
                "For luggage, use takkyubin, the luggage forwarding service. Your hotel front "
                "desk can send your suitcases to your next hotel for roughly 2,000 to 3,000 yen "
                "per bag, usually arriving the next day. Pack a small overnight bag for the "
                "night the suitcases are in transit."
            ),
            (
                "Perfect. Last question: we want one really memorable dinner in Kyoto, something "
                "traditional but not absurdly expensive. What kind of place should we look for "
                "and how far ahead do we need to book?"
            ),
        ),
        output_len=520,
    ),
    Conversation(
        topic="sourdough starter",
        turns=(
            (
                "My sourdough starter is two weeks old and it still doesn't double. It bubbles a "
                "little after feeding but smells like nail polish remover. I feed it once a day "
                "with 50 g flour and 50 g water. What's going on?"
            ),
            (
                "The nail polish smell is acetone-like ethyl acetate, a sign that your starter "
                "is hungry: the yeast and bacteria ran out of food long before the next feeding. "
                "It is not spoiled. Once a day at equal weights is often too little once a "
                "starter gets active, especially in a warm kitchen.\n"
                "\n"
                "Try feeding twice a day, about 12 hours apart, and discard more before each "
                "feeding so the ratio is 1 part starter, 2 parts flour, 2 parts water. Adding 10 "
                "to 20 percent whole wheat or rye flour gives the microbes more nutrients and "
                "usually speeds things up. Keep it somewhere around 24 to 26 degrees Celsius if "
                "you can."
            ),
            (
                "I switched to twice a day with some rye and it's doubling in about 6 hours now. "
                "How do I know when it's ready to bake with, and can I keep it in the fridge so "
                "I don't have to feed it every day?"
            ),
        ),
        output_len=260,
    ),
    Conversation(
        topic="beginner running",
        turns=(
            (
                "I'm 38, haven't exercised in years, and want to be able to run 5k without "
                "stopping by the end of summer. I get out of breath after about one minute of "
                "jogging. Where do I start?"
            ),
            (
                "Being out of breath after a minute is completely normal at the start, and the "
                "fix is to slow down and alternate running with walking. A classic approach is a "
                "couch-to-5k style plan: three sessions a week on non-consecutive days, each "
                "about 30 minutes.\n"
                "\n"
                "Weeks 1-2: after a 5 minute brisk walk, alternate 1 minute of very easy jogging "
                "with 90 seconds of walking, eight times.\n"
                "Weeks 3-4: 90 seconds jogging, 2 minutes walking.\n"
                "Weeks 5-6: 3 minutes jogging, 90 seconds walking.\n"
                "From there, keep stretching the running parts until you run 20, then 30 "
                "minutes.\n"
                "\n"
                "The pace should be slow enough that you could speak in short sentences. Good "
                "shoes that fit well matter more than any gadget."
            ),
            (
                "I did the first week and my shins hurt on the front side after each run. Is "
                "that normal, should I push through, or stop? I'm also not sure if I should run "
                "on pavement or find a track or trails."
            ),
        ),
        output_len=400,
    ),
    Conversation(
        topic="emergency fund vs debt",
        turns=(
            (
                "I have about 6,000 dollars in savings, a credit card balance of 4,500 at 24 "
                "percent interest, and a car loan at 5 percent. My job is fairly stable. Should "
                "I pay off the card completely or keep the cash as an emergency fund?"
            ),
            (
                "A 24 percent card is one of the most expensive debts there is, so paying it "
                "down is almost always the priority. The risk of paying it off completely is "
                "being left with 1,500 dollars, and if an emergency then hits, it goes straight "
                "back on the card at 24 percent.\n"
                "\n"
                "A common middle path: keep a starter emergency fund of about one month of "
                "essential expenses, put everything else toward the card right now, and then "
                "direct what you were paying on the card each month into rebuilding savings. The "
                "car loan at 5 percent can stay on its normal schedule; it costs much less than "
                "the card and there is no benefit to rushing it while you have no cushion."
            ),
            (
                "My monthly essentials are around 2,200. So I'd pay 3,800 on the card now and "
                "have 700 left on it. After that, how big should my emergency fund be, and "
                "should it sit in a normal savings account or somewhere else?"
            ),
        ),
        output_len=380,
    ),
    Conversation(
        topic="remote work email",
        turns=(
            (
                "Can you help me write an email to my manager asking to work from home two days "
                "a week? I've been at the company for three years, my commute is 90 minutes each "
                "way, and my team is already spread across two offices so most meetings are on "
                "video anyway."
            ),
            (
                "Here is a draft you can adapt:\n"
                "\n"
                "Subject: Proposal: working from home two days a week\n"
                "\n"
                "Hi Dana,\n"
                "\n"
                "I'd like to propose working from home on Tuesdays and Thursdays. Since most of "
                "our team meetings are already on video across both offices, I don't expect this "
                "to change how we collaborate, and it would give me back about three hours on "
                "each of those days that I could put into focused work.\n"
                "\n"
                "I'm happy to try it for a month and review how it's going together. I'd stay "
                "reachable during core hours and come in on those days whenever something needs "
                "me on site.\n"
                "\n"
                "Could we talk about it in our next one-on-one?\n"
                "\n"
                "Thanks,\n"
                "Sam"
            ),
            (
                "That's good but a bit too formal for our team, we're pretty casual. Also my "
                "manager is worried about juniors not getting enough support, so I want to "
                "address that. Can you make it shorter and more relaxed and mention that I'd "
                "keep my office days for pairing with the two new hires?"
            ),
        ),
        output_len=300,
    ),
    Conversation(
        topic="causes of world war one",
        turns=(
            (
                "I'm studying for a history exam. Can you explain the main causes of World War "
                "One in a way that's easy to remember?"
            ),
            (
                "A popular memory aid is MAIN plus the spark:\n"
                "\n"
                "Militarism: the great powers built up huge armies and navies, and Britain and "
                "Germany were locked in a naval arms race. Generals had detailed mobilization "
                "plans that were hard to stop once started.\n"
                "\n"
                "Alliances: Europe was split into two blocs, the Triple Entente (France, Russia, "
                "Britain) and the Triple Alliance (Germany, Austria-Hungary, Italy), so a local "
                "conflict could pull everyone in.\n"
                "\n"
                "Imperialism: competition for colonies and influence, for example over Morocco, "
                "created repeated crises and deep mistrust.\n"
                "\n"
                "Nationalism: pride and rivalry between nations, and nationalist movements "
                "inside empires, especially Slavic nationalism in the Balkans, which threatened "
                "Austria-Hungary.\n"
                "\n"
                "The spark was the assassination of Archduke Franz Ferdinand in Sarajevo in June "
                "1914 by a Bosnian Serb nationalist."
            ),
            (
                "Our teacher says that MAIN is too simple and that we should be able to discuss "
                "which cause historians think mattered most. Can you give me the main arguments, "
                "like the debate about German responsibility, so I can write an essay on it?"
            ),
        ),
        output_len=550,
    ),
    Conversation(
        topic="bayes theorem",
        turns=(
            (
                "Can someone explain Bayes theorem without formulas first? I keep memorizing it "
                "and forgetting it."
            ),
            (
                "Think of it as updating a belief with evidence. You start with how likely "
                "something is before seeing evidence, the prior. Then you ask how much more "
                "likely the evidence is if the thing is true than if it is false. The stronger "
                "that ratio, the more the evidence should move your belief.\n"
                "\n"
                "The classic surprise is a medical test. If a disease is rare, say 1 in 1,000 "
                "people have it, even a test that is 99 percent accurate produces many more "
                "false positives among the 999 healthy people than true positives among the 1 "
                "sick person. So a positive result still leaves the chance of being sick quite "
                "low, around 9 percent in that example."
            ),
            (
                "OK that example helps. Can you now walk me through the actual numbers for that "
                "medical test example step by step with the formula, and then show what happens "
                "if the person takes a second independent test that also comes back positive?"
            ),
        ),
        output_len=420,
    ),
    Conversation(
        topic="yellow tomato leaves",
        turns=(
            (
                "The lower leaves on my tomato plants are turning yellow with brown spots, "
                "starting from the bottom of the plant. It's been really rainy lately. What "
                "should I do?"
            ),
            (
                "Yellowing lower leaves with brown spots after a wet spell is most often early "
                "blight or septoria leaf spot, both fungal diseases that splash up from the "
                "soil. Remove the affected leaves (and throw them away rather than composting "
                "them), water at the base of the plant in the morning instead of over the "
                "leaves, and add a layer of mulch so rain doesn't splash soil onto the foliage. "
                "Pruning the lowest branches so nothing touches the ground helps air circulate."
            ),
            (
                "Thanks. Can I still eat the tomatoes from these plants, and should I spray "
                "something like copper fungicide, or is that overkill for a small home garden?"
            ),
        ),
        output_len=240,
    ),
    Conversation(
        topic="spanish subjunctive",
        turns=(
            (
                "When do I use the subjunctive in Spanish? My textbook lists like fifteen rules "
                "and I can't keep them straight."
            ),
            (
                "Most uses boil down to one idea: the subjunctive marks things that are not "
                "presented as plain facts. The acronym WEIRDO covers the main triggers when "
                'there is a change of subject after "que":\n'
                "\n"
                "Wishes: Quiero que vengas.\n"
                "Emotions: Me alegra que estés aquí.\n"
                "Impersonal expressions: Es importante que estudies.\n"
                "Recommendations: Te recomiendo que lo pruebes.\n"
                "Doubt and denial: Dudo que sea verdad.\n"
                "Ojalá: Ojalá llueva mañana.\n"
                "\n"
                'Compare "Creo que es verdad" (belief presented as fact, indicative) with "No '
                'creo que sea verdad" (doubt, subjunctive).'
            ),
            (
                "That's way clearer. What about after words like cuando and aunque? I've seen "
                'both "cuando llegas" and "cuando llegues" and I don\'t get the difference.'
            ),
        ),
        output_len=350,
    ),
    Conversation(
        topic="undo pushed git commit",
        turns=(
            (
                "I pushed a commit to the main branch that accidentally included a config file "
                "with a database password. How do I undo it? Other people have already pulled."
            ),
            (
                "First and most important: treat the password as leaked and rotate it now. Once "
                "a secret has been pushed to a shared remote, you cannot be sure nobody copied "
                "it, and rewriting history does not remove it from clones others already have.\n"
                "\n"
                "Then, since others have pulled, the safe way to undo the change is `git revert "
                "<commit>`, which adds a new commit that undoes it without rewriting history. "
                "Also add the config file to .gitignore and keep a config.example file with "
                "placeholders instead.\n"
                "\n"
                "If your policy requires removing the file from history entirely, tools like git "
                "filter-repo can do it, but everyone will have to re-clone or reset their "
                "branches, so coordinate with the team first."
            ),
            (
                "We rotated the password already. The team agreed to rewrite history. Can you "
                "give me the exact git filter-repo commands and what everyone else needs to run "
                "afterwards so their local copies don't bring the old commit back?"
            ),
        ),
        output_len=300,
    ),
    Conversation(
        topic="slow sql join",
        turns=(
            (
                "This query takes about 40 seconds on Postgres and I don't understand why. The "
                "orders table has 20 million rows and customers has 2 million.\n"
                "\n"
                "SELECT c.country, count(*) AS orders, sum(o.total) AS revenue\n"
                "FROM orders o\n"
                "JOIN customers c ON c.id = o.customer_id\n"
                "WHERE o.created_at >= now() - interval '30 days'\n"
                "  AND o.status = 'paid'\n"
                "GROUP BY c.country\n"
                "ORDER BY revenue DESC;\n"
                "\n"
                "There's an index on orders(customer_id) and the primary key on customers(id). "
                "What should I look at?"
            ),
            (
                "Start with EXPLAIN (ANALYZE, BUFFERS) to see where the time goes, but the "
                "likely culprit is that nothing helps Postgres find the last 30 days of paid "
                "orders quickly. With only an index on customer_id, it probably scans all 20 "
                "million orders and filters them.\n"
                "\n"
                "An index that matches the WHERE clause usually fixes this:\n"
                "\n"
                "CREATE INDEX CONCURRENTLY orders_paid_recent\n"
                "ON orders (created_at) WHERE status = 'paid';\n"
                "\n"
                "A partial index like this stays small because it only contains paid orders. If "
                "you want an index-only scan, include the columns the query reads: (created_at) "
                "INCLUDE (customer_id, total). Also make sure the table has been analyzed "
                "recently so the planner has good statistics."
            ),
            (
                "I added the partial index and the EXPLAIN now shows an index scan on orders, "
                "but the query still takes 12 seconds. Most of the time seems to be in a hash "
                "join with customers. Here's the relevant part of the plan:\n"
                "\n"
                "Hash Join (actual time=3100.2..11890.4 rows=1840221 loops=1)\n"
                "  Hash Cond: (o.customer_id = c.id)\n"
                "  -> Index Scan using orders_paid_recent on orders o (actual time=0.05..2300.8 "
                "rows=1840221)\n"
                "  -> Hash (actual time=3050.1..3050.1 rows=2000000)\n"
                "        Buckets: 262144 Batches: 16 Memory Usage: 9000kB\n"
                "        -> Seq Scan on customers c (actual time=0.02..1400.3 rows=2000000)\n"
                "\n"
                "What does Batches: 16 mean and how do I make this faster?"
            ),
        ),
        output_len=450,
    ),
    Conversation(
        topic="summarize climate policy",
        turns=(
            (
                "Please summarize the following in three bullet points for a busy reader:\n"
                "\n"
                "Carbon pricing has emerged as one of the most widely discussed tools for "
                "reducing greenhouse gas emissions. The principle is simple: by attaching a "
                "price to each tonne of carbon dioxide emitted, governments make polluting "
                "activities more expensive and cleaner alternatives relatively cheaper, allowing "
                "markets to find the lowest-cost ways to cut emissions. There are two main "
                "designs. A carbon tax sets the price directly and lets the quantity of "
                "emissions adjust, while a cap-and-trade system fixes the total quantity of "
                "allowed emissions and lets the price emerge from trading among firms. Both "
                "approaches have been implemented in various forms: Sweden has levied a carbon "
                "tax since 1991 that is now among the highest in the world, and the European "
                "Union has operated an emissions trading system since 2005. Critics raise "
                "concerns about competitiveness, arguing that domestic industries may lose out "
                "to producers in countries without similar policies, a problem known as carbon "
                "leakage. Border carbon adjustments, which charge importers for the emissions "
                "embedded in their goods, are one proposed remedy, and the EU has begun phasing "
                "in such a mechanism. Another major concern is fairness, because energy costs "
                "make up a larger share of spending for lower-income households. Several "
                "jurisdictions address this by returning the revenue to citizens as equal "
                "dividends, which can leave most low-income households better off overall. "
                "Evidence so far suggests that carbon prices have reduced emissions modestly "
                "where they are high enough, though in many systems the price has historically "
                "been too low to drive deep change."
            ),
            (
                "- Carbon pricing makes emitting CO2 cost money, either through a tax that fixes "
                "the price (Sweden since 1991) or a cap-and-trade system that fixes total "
                "emissions (EU since 2005), so markets find the cheapest cuts.\n"
                "- The main worries are competitiveness (carbon leakage), addressed by border "
                "carbon adjustments, and fairness for low-income households, addressed by "
                "returning revenue as equal dividends.\n"
                "- Where prices are high enough, emissions have fallen modestly, but many "
                "systems have priced carbon too low to drive deep reductions."
            ),
            (
                "Good. Now rewrite it as a single short paragraph that I could read aloud in "
                "about 30 seconds at the start of a meeting."
            ),
        ),
        output_len=220,
    ),
    Conversation(
        topic="product manager interview",
        turns=(
            (
                "I have a product manager interview next week at a mid-size fintech company. I'm "
                "coming from a software engineering background. What kinds of questions should I "
                "expect?"
            ),
            (
                "PM interviews usually mix a few question types, and coming from engineering you "
                "will want to spend most of your preparation on the ones that are least "
                "technical.\n"
                "\n"
                'Product sense: "How would you improve our mobile app?" or "Design a savings '
                'feature for students." They look for a structured approach: user segments, '
                "their problems, prioritization, and how you would measure success.\n"
                'Execution and metrics: "Sign-ups dropped 10 percent last week, what do you '
                'do?" or "What metrics would you track for this feature?"\n'
                "Behavioral: conflicts with engineers or designers, a product decision you got "
                "wrong, influencing without authority.\n"
                "Technical: usually light for a PM role, though in fintech expect questions "
                "about APIs, reliability or compliance.\n"
                "Company-specific: why this company, what you think of their product and "
                "competitors."
            ),
            (
                "The product sense questions scare me the most. Can you walk me through a full "
                'example answer for "Design a feature that helps users of our banking app save '
                'more money", the way a strong candidate would structure it out loud, including '
                "how they'd pick which idea to build first?"
            ),
        ),
        output_len=480,
    ),
    Conversation(
        topic="leaky faucet",
        turns=(
            (
                "My kitchen faucet drips constantly from the spout even when the handle is fully "
                "off. It's a single-handle faucet, maybe 10 years old. Can I fix this myself?"
            ),
            (
                "Usually yes. On a single-handle faucet a constant drip from the spout almost "
                "always means the cartridge (or, on ball-type faucets, the seats and springs) is "
                "worn. The repair is: shut off the water under the sink, open the faucet to "
                "release pressure, pop off the decorative cap on the handle, remove the handle "
                "screw and handle, unscrew the retaining nut, and pull out the cartridge. Take "
                "it to a hardware store to get an exact match, or look for the brand and model "
                "on the faucet."
            ),
            (
                "I got the handle off but the cartridge is completely stuck, it won't budge even "
                "with pliers. I'm afraid of breaking something. Any tricks, and is there a point "
                "where I should just replace the whole faucet instead?"
            ),
        ),
        output_len=280,
    ),
    Conversation(
        topic="toddler sleep",
        turns=(
            (
                "Our two-year-old has started fighting bedtime every night. It used to take 10 "
                "minutes, now it takes over an hour with crying, more books, water, and coming "
                "out of the room again and again. We're exhausted. Any advice?"
            ),
            (
                "This is very common around two: kids are testing limits, and they are also "
                "developing fears and a stronger sense of independence. A few things help most "
                "families:\n"
                "\n"
                "Keep a short, predictable routine, about 20 to 30 minutes, in the same order "
                "every night, maybe with a picture chart they can follow.\n"
                "Build the requests into the routine: a drink of water and a set number of books "
                "before lights out, so there is nothing left to ask for.\n"
                "Check that bedtime isn't too early now that naps may be shorter; an overtired "
                "or undertired child fights sleep.\n"
                "When they come out, walk them back calmly with as little talking as possible, "
                "every time. Consistency matters more than the exact method."
            ),
            (
                "We tried the chart and the fixed number of books and it's a bit better. But now "
                "she says she's scared of the dark and cries when we leave the room. Is it okay "
                "to stay until she falls asleep, or will that create a new habit we'll have to "
                "break later?"
            ),
        ),
        output_len=360,
    ),
    Conversation(
        topic="why is the sky blue",
        turns=(
            ("Why is the sky blue and not violet, if violet light has an even shorter wavelength?"),
            (
                "Sunlight scatters off air molecules, and shorter wavelengths scatter much more "
                "strongly, roughly with the inverse fourth power of the wavelength. That is "
                "Rayleigh scattering, and it is why blue light comes at us from all directions "
                "of the sky. Violet scatters even more, but three things work against it: the "
                "sun emits less violet than blue, some violet is absorbed high in the "
                "atmosphere, and our eyes are much less sensitive to violet. What reaches our "
                "eyes is a mix that our color vision reads as sky blue."
            ),
            ("Then why are sunsets red and orange? Shouldn't all the light scatter the same way?"),
        ),
        output_len=200,
    ),
    Conversation(
        topic="story opening feedback",
        turns=(
            (
                "I'm writing a short story and would love honest feedback on the opening "
                "paragraph. Here it is:\n"
                "\n"
                "The lighthouse had been dark for eleven years when Mara came back to Hollow "
                "Point. She told herself it was for her mother's funeral, and that was true, but "
                "it was also true that she had nowhere else to go. The town looked smaller than "
                "she remembered, the way towns do when you have spent a decade telling yourself "
                "you were too big for them. The bakery was now a phone repair shop. The church "
                "had a new roof. And the lighthouse, which her father had kept until the night "
                "he walked into the sea, stood at the end of the point like a question nobody in "
                "town was willing to answer. She parked the rental car at the bottom of the hill "
                "and sat with the engine running, watching the gulls argue over something on the "
                "rocks, and tried to remember the last thing she had said to her mother. It had "
                "been on the phone. It had been about money. It had not been kind.\n"
                "\n"
                "Is it too slow? I'm worried nothing happens."
            ),
            (
                "It isn't too slow. Plenty happens, just quietly: a funeral, a homecoming, a "
                "father's death and a broken relationship with the mother, all in one paragraph. "
                "The strongest moves are the specific details (the bakery turned phone repair "
                "shop, the new church roof) and the last three short sentences, which land hard. "
                'The lighthouse "like a question nobody in town was willing to answer" sets up '
                "the central mystery nicely.\n"
                "\n"
                'If anything, the middle could be tighter. "The way towns do when you have '
                'spent a decade telling yourself you were too big for them" is a good line, but '
                'the sentence around it is a little long, and you could trim "She told herself '
                "it was for her mother's funeral, and that was true, but it was also true\" to "
                "something more direct."
            ),
            (
                "Thanks! I'm planning for the story to be about 4,000 words. Could you suggest "
                "how the plot could develop from here, like three or four key scenes, without "
                "making the lighthouse mystery too obvious or turning it into a ghost story?"
            ),
        ),
        output_len=500,
    ),
    Conversation(
        topic="vegetarian protein",
        turns=(
            (
                "I went vegetarian three months ago and I'm lifting weights four times a week. "
                "How much protein do I actually need, and can I get it without eating tofu every "
                "single day?"
            ),
            (
                "For people who lift regularly, research generally supports about 1.6 grams of "
                "protein per kilogram of body weight per day, with some benefit up to around 2.2 "
                "g/kg. So a 70 kg person would aim for roughly 110 to 150 grams a day.\n"
                "\n"
                "As a vegetarian you have many options besides tofu: eggs, Greek yogurt, cottage "
                "cheese, milk, tempeh, seitan, lentils, chickpeas, beans, edamame, and protein "
                "powder (whey or plant-based). Spreading protein over three or four meals, each "
                "with 25 to 40 grams, works well for muscle growth."
            ),
            (
                "I weigh 82 kg. Could you put together a sample day of meals that hits around "
                "150 grams of protein, mostly with foods I can buy at a normal supermarket and "
                "cook in under 30 minutes?"
            ),
        ),
        output_len=330,
    ),
    Conversation(
        topic="javascript async errors",
        turns=(
            (
                "In my Node.js app, errors inside async functions sometimes just disappear and "
                "the process keeps running as if nothing happened. Here's a simplified version:\n"
                "\n"
                'app.get("/report", (req, res) => {\n'
                "  buildReport(req.query.id).then(report => {\n"
                "    res.json(report);\n"
                "  });\n"
                "});\n"
                "\n"
                "async function buildReport(id) {\n"
                "  const data = await db.load(id);\n"
                '  if (!data) throw new Error("not found");\n'
                "  return summarize(data);\n"
                "}\n"
                "\n"
                "When the id doesn't exist the request just hangs forever. Why?"
            ),
            (
                "The promise returned by buildReport rejects, but nothing handles the rejection: "
                "there is a .then for success and no .catch, so the request handler never sends "
                "a response and the client waits until it times out. Depending on your Node "
                'version you may see an "unhandledRejection" warning, or the process may crash '
                "with newer defaults.\n"
                "\n"
                "Handle the error explicitly:\n"
                "\n"
                'app.get("/report", async (req, res) => {\n'
                "  try {\n"
                "    res.json(await buildReport(req.query.id));\n"
                "  } catch (err) {\n"
                '    res.status(err.message === "not found" ? 404 : 500).json({ error: '
                "err.message });\n"
                "  }\n"
                "});\n"
                "\n"
                "Express 4 does not catch errors from async handlers by itself, so either wrap "
                "every handler like this, use a small wrapper function, or upgrade to Express 5 "
                "which forwards rejected promises to your error middleware."
            ),
            (
                "Makes sense. I have about 40 routes though, and I don't want to write try/catch "
                "everywhere. Can you show me how to write that wrapper function and a central "
                "error-handling middleware, and how to define my own error classes so I can "
                "return 404 for not found and 400 for validation errors?"
            ),
        ),
        output_len=420,
    ),
    Conversation(
        topic="cat and dog introduction",
        turns=(
            (
                "We're adopting a 3 year old cat next week. We already have a 5 year old "
                "labrador who is friendly but very excitable. How do we introduce them without "
                "it going badly?"
            ),
            (
                "Slow and boring is the goal. Give the cat her own room with litter, food, water "
                "and hiding spots for the first several days, and let the two animals get used "
                "to each other's smell by swapping blankets and rubbing a cloth on each and "
                "leaving it near the other's food.\n"
                "\n"
                "After that, do short visual introductions through a baby gate or a cracked door "
                "while the dog is on a leash and getting treats for staying calm. Only when both "
                "are relaxed should you let them share a room, with the dog leashed at first. "
                "Make sure the cat always has high places and escape routes the dog can't reach, "
                "and keep her food and litter box out of the dog's reach."
            ),
            (
                "The first gate meetings went okay, but the dog whines and stares at the cat "
                "intensely the whole time, and the cat hisses at him. How long should we keep "
                "doing this before trying a room together, and what signs should tell us it's "
                "going well or badly?"
            ),
        ),
        output_len=300,
    ),
    Conversation(
        topic="guitar chords",
        turns=(
            (
                "I just started learning guitar. My fingers hurt, and switching from G to C "
                "takes me forever. Is there a trick?"
            ),
            (
                "Sore fingertips are normal for the first few weeks and they will toughen up; "
                "keep sessions short, 15 to 20 minutes a couple of times a day, rather than one "
                "long one.\n"
                "\n"
                "For the G to C change, look for anchor fingers: depending on which G shape you "
                "use, your ring finger can stay close to the same area. Practice just the change "
                "itself, slowly: one strum on G, one on C, back and forth for a minute, without "
                'worrying about rhythm. Then do "one minute changes": count how many clean '
                "changes you make in a minute and try to beat it each day."
            ),
            (
                "I've been doing the one minute changes for a week and I'm at 28 changes. What "
                "songs could I practice that mostly use G, C, D and E minor, and what strumming "
                "pattern should I learn first?"
            ),
        ),
        output_len=260,
    ),
    Conversation(
        topic="disk full linux",
        turns=(
            (
                'My Ubuntu server says "No space left on device" and the app stopped writing '
                "logs. df -h shows / at 100 percent. How do I quickly find what's eating the "
                "disk?"
            ),
            (
                "A quick way to drill down:\n"
                "\n"
                "sudo du -xh --max-depth=1 / 2>/dev/null | sort -h\n"
                "\n"
                "The -x keeps du on the root filesystem. Then repeat on the biggest directory, "
                "usually /var, until you find the culprit. Common ones are /var/log (huge or "
                "unrotated logs), /var/lib/docker (old images and containers), and "
                "/var/cache/apt.\n"
                "\n"
                "Also check for deleted files still held open by a running process, which use "
                "space but don't appear in du:\n"
                "\n"
                "sudo lsof +L1\n"
                "\n"
                "If a big log was deleted while the app still has it open, the space is only "
                "freed when the process restarts or closes the file."
            ),
            (
                "It was a 40 GB application log in /var/log/myapp that never got rotated. I "
                "truncated it and we're back to 60 percent. How do I set up logrotate for it so "
                "this doesn't happen again, given that the app keeps the file open and doesn't "
                "reopen it on a signal?"
            ),
        ),
        output_len=340,
    ),
    Conversation(
        topic="trolley problem",
        turns=(
            (
                "What's the point of the trolley problem? It seems like a silly thought "
                "experiment that never happens in real life."
            ),
            (
                "It is artificial on purpose. Like a physics experiment that removes friction, "
                "it strips away everything except one question: is there a moral difference "
                "between doing harm and allowing harm, or between harming someone as a means and "
                "harming them as a side effect?\n"
                "\n"
                "Most people say it is acceptable to pull a lever that diverts the trolley and "
                "kills one person instead of five, but not to push a large man off a bridge to "
                "stop it, even though the numbers are the same. Explaining that difference is "
                "hard, and the attempts reveal a lot about the principles people actually use, "
                "such as the doctrine of double effect or the idea that people should not be "
                "used merely as tools.\n"
                "\n"
                "And versions of it do happen: triage in hospitals, how self-driving cars should "
                "behave in unavoidable crashes, and public health decisions that trade some "
                "risks against others."
            ),
            (
                "Okay, but then which answer is correct? I've heard utilitarians say you should "
                "push the man, and Kantians say you shouldn't pull the lever either. Can you lay "
                "out the strongest argument on each side and then tell me what you think is the "
                "most defensible position?"
            ),
        ),
        output_len=430,
    ),
    Conversation(
        topic="saas pricing",
        turns=(
            (
                "I'm launching a small SaaS tool for dental clinics that handles appointment "
                "reminders by text and email. I have 12 clinics in a free beta. How should I "
                "figure out pricing?"
            ),
            (
                "Start from the value you create rather than your costs. For a dental clinic, a "
                "missed appointment might cost 100 to 200 dollars in lost revenue, so if your "
                "reminders prevent even a few no-shows a month, the tool is worth a lot more "
                "than the cost of sending texts.\n"
                "\n"
                "Practical steps: ask your beta clinics how many no-shows they had before and "
                "after, and put a dollar number on it. Ask each clinic manager directly what "
                "they would expect to pay and at what price it would feel expensive. Look at "
                "what they pay competitors or practice management add-ons today. Then consider "
                "simple tiers, for example by number of providers or locations, since that "
                "tracks the clinic's size and ability to pay."
            ),
            (
                "The beta clinics went from about 14 no-shows a month to 8 on average. A couple "
                "of them said they'd pay \"maybe 50 dollars a month\" but I feel like that's too "
                "low. My costs are about 6 dollars per clinic per month for SMS. How would you "
                "structure the tiers and what would you charge, and how do I move the beta "
                "clinics to paid without losing them?"
            ),
        ),
        output_len=460,
    ),
    Conversation(
        topic="resume bullets",
        turns=(
            (
                "Can you help me rewrite these resume bullet points? I'm applying for data "
                "analyst roles and I feel like they sound weak:\n"
                "\n"
                "- Responsible for making weekly reports for the sales team\n"
                "- Worked with Excel and SQL to get data\n"
                "- Helped the marketing team with their dashboard\n"
                "- Cleaned up the customer database\n"
                "- Did analysis on why customers were leaving\n"
                "\n"
                "Some context: the weekly reports went to about 30 salespeople and I automated "
                "them so they went from taking a full day to about 20 minutes. The dashboard was "
                "in Tableau and tracked campaign performance across 6 channels. The customer "
                "database had about 200,000 records and lots of duplicates, I got the duplicate "
                "rate from around 8 percent to under 1 percent. The churn analysis found that "
                "customers who didn't use a specific feature in the first two weeks were three "
                "times more likely to cancel, and the product team built an onboarding email "
                "series because of it."
            ),
            (
                "Here is a stronger version, leading with actions and results:\n"
                "\n"
                "- Automated weekly sales reporting for a 30-person sales team with SQL and "
                "Excel, cutting preparation time from one day to 20 minutes\n"
                "- Built a Tableau dashboard tracking campaign performance across 6 marketing "
                "channels, used by the marketing team for weekly budget decisions\n"
                "- Deduplicated and cleaned a 200,000-record customer database, reducing the "
                "duplicate rate from 8 percent to under 1 percent\n"
                "- Identified a key churn driver: customers who skipped a core feature in their "
                "first two weeks were 3x more likely to cancel, leading the product team to "
                "launch an onboarding email series"
            ),
            (
                "These are much better. The job posting mentions Python and A/B testing a lot, "
                "and I did use pandas for the churn analysis and I helped evaluate one A/B test "
                "on the pricing page. How can I work those in without exaggerating, and should I "
                "add a skills section or a short summary at the top?"
            ),
        ),
        output_len=380,
    ),
    Conversation(
        topic="p values",
        turns=(
            (
                "What does a p-value of 0.03 actually mean? My stats professor's explanation "
                "went over my head."
            ),
            (
                "It means: if there were truly no effect (the null hypothesis is true), you "
                "would see results at least as extreme as yours only about 3 percent of the "
                "time, just from random variation. A small p-value says your data would be "
                "surprising under the assumption of no effect.\n"
                "\n"
                "What it does not mean is just as important: it is not the probability that the "
                "null hypothesis is true, it is not a 97 percent chance that your finding is "
                "real, and it says nothing about how big or important the effect is."
            ),
            (
                "So if a study finds p = 0.03 for a new drug, why do people say that doesn't "
                'prove the drug works? And what is this "replication crisis" that my professor '
                "keeps mentioning in connection with p-values?"
            ),
        ),
        output_len=390,
    ),
    Conversation(
        topic="brake noise",
        turns=(
            (
                "My car makes a grinding noise when I brake, mostly at low speed. It started a "
                "few days ago. Is it safe to keep driving until I can get an appointment in two "
                "weeks?"
            ),
            (
                "Grinding when braking usually means the brake pads are worn down to the metal "
                "backing plate, which is now rubbing against the rotor. It is not something to "
                "wait two weeks on: braking performance can drop, and every trip grinds the "
                "rotors further, turning a cheap pad replacement into a more expensive pad and "
                "rotor job. Drive as little as possible and call around; many shops can do "
                "brakes the same or next day. Less often it is a stone stuck between the rotor "
                "and the dust shield, which a mechanic can clear in minutes."
            ),
            (
                "The shop says I need pads and rotors on the front for 480 dollars. Does that "
                "sound reasonable, and is it worth doing myself? I've changed my own oil but "
                "never touched brakes."
            ),
        ),
        output_len=250,
    ),
    Conversation(
        topic="saturn telescope",
        turns=(
            (
                "I have a cheap 70mm refractor telescope. Can I see Saturn's rings with it, and "
                "when is the best time to look?"
            ),
            (
                "Yes. A 70 mm refractor shows Saturn's rings clearly at around 50 to 100x "
                "magnification, and on a steady night you may also spot Titan, its largest moon, "
                "as a faint star nearby. Saturn is best observed around opposition, when it is "
                "closest to Earth and visible all night; check a free app like Stellarium for "
                "when it rises where you live. Look when it is high in the sky, since light "
                "passing through less atmosphere gives a steadier image."
            ),
            (
                "I found it last night but it looked like a tiny blurry blob with ears, not "
                "sharp at all. What am I doing wrong?"
            ),
        ),
        output_len=230,
    ),
    Conversation(
        topic="docker host database",
        turns=(
            (
                "My app runs in a Docker container and needs to connect to a Postgres database "
                "running directly on my laptop (not in Docker). Connecting to localhost:5432 "
                'from the container fails with "connection refused". Why?'
            ),
            (
                "Inside a container, localhost refers to the container itself, not your laptop, "
                "so the app is looking for Postgres inside its own container. On Docker Desktop "
                "(Mac and Windows) use the special hostname host.docker.internal instead of "
                "localhost. On Linux, start the container with "
                "--add-host=host.docker.internal:host-gateway to get the same name.\n"
                "\n"
                "Also check that Postgres accepts connections from outside the loopback "
                "interface: listen_addresses in postgresql.conf, and a matching rule in "
                "pg_hba.conf for the Docker network."
            ),
            (
                "I'm on Linux and used --add-host. Now I get \"no pg_hba.conf entry for host "
                "172.17.0.2\". I'd rather not open Postgres to my whole network. What's the "
                "minimal safe config change, and would it be better to just run Postgres in "
                "Docker too with docker compose?"
            ),
        ),
        output_len=320,
    ),
    Conversation(
        topic="kids birthday party",
        turns=(
            (
                "I'm planning a birthday party for my daughter who turns 10 next month. Around "
                "12 kids, at our house, budget of about 200 dollars. She loves science and "
                "mystery stories. Any ideas?"
            ),
            (
                "A detective science party combines both nicely. Kids arrive as junior "
                'detectives (print simple badges), and the party is built around solving "The '
                'Case of the Missing Cake".\n'
                "\n"
                "Stations could include: fingerprint dusting with cocoa powder and tape, a "
                "secret message written in lemon juice revealed by a hair dryer, chromatography "
                "with markers and coffee filters to find which pen wrote the ransom note, and a "
                "simple chemistry test where baking soda fizzes in vinegar to identify a mystery "
                "powder. Each solved station gives a clue, and the last clue leads to the hidden "
                "cake. Most supplies are household items, which keeps the budget well under 200 "
                "dollars even with food and small prizes."
            ),
            (
                "She loves it! Can you write the actual mystery story and the clues for each "
                "station, so that the kids have to use the results of all four experiments to "
                "figure out which of four suspects took the cake? The suspects could be our "
                "family's cat, her grandpa, the neighbor, and her little brother."
            ),
        ),
        output_len=350,
    ),
    Conversation(
        topic="inflation interest rates",
        turns=(
            (
                "Why do central banks raise interest rates when inflation is high? It seems like "
                "it would just make everything more expensive, like mortgages."
            ),
            (
                "It works through demand. Higher interest rates make borrowing more expensive "
                "and saving more attractive, so households and businesses spend and invest less: "
                "fewer people take out mortgages or car loans, companies delay expansions. With "
                "less spending chasing the same amount of goods and services, price increases "
                "slow down.\n"
                "\n"
                "You are right that it hurts: people with variable-rate mortgages or new loans "
                "pay more, and slowing the economy can raise unemployment. Central banks accept "
                "that short-term pain because they believe persistent high inflation is worse, "
                "since it erodes wages and savings and becomes self-reinforcing when people "
                "start expecting it."
            ),
            (
                "But some of the recent inflation came from things like energy prices and supply "
                "chain problems. How can higher interest rates fix a supply problem? Isn't that "
                "the wrong tool? I'd like to understand the arguments on both sides."
            ),
        ),
        output_len=410,
    ),
    Conversation(
        topic="meeting notes action items",
        turns=(
            (
                "Here are my messy notes from today's project meeting. Can you turn them into a "
                "clean list of action items with owners and deadlines, and a short summary of "
                "the decisions?\n"
                "\n"
                "proj sync, 14 may. present: ana, raj, li, tom, me\n"
                "- launch date still 3 june? raj says payments integration not done, vendor "
                "sandbox flaky. ana thinks we can do 10 june if needed. decided: move launch to "
                "10 june, tell marketing (me by friday)\n"
                "- li: load test results, p99 latency ok under 2x expected traffic but db cpu at "
                "85pct. needs read replica before launch. raj to check cost, decide by next tue\n"
                "- tom: app store review takes ~1 week, must submit by 1 june latest. tom owns "
                "submission\n"
                "- bug backlog 23 open, 4 critical. ana triage and assign critical ones by wed\n"
                "- marketing wants demo video, no owner yet. li maybe? li said ok if someone "
                "else does voiceover. me to ask design team for voiceover\n"
                "- next sync 21 may same time"
            ),
            (
                "Summary of decisions:\n"
                "- Launch moves from 3 June to 10 June because the payments integration is not "
                "finished.\n"
                "- A database read replica is needed before launch, pending a cost check.\n"
                "- The app must be submitted to the app store by 1 June at the latest.\n"
                "\n"
                "Action items:\n"
                "- Me: tell marketing about the new launch date, by Friday\n"
                "- Me: ask the design team for a demo video voiceover\n"
                "- Raj: check the cost of a read replica and decide, by Tuesday 20 May\n"
                "- Ana: triage and assign the 4 critical bugs, by Wednesday 15 May\n"
                "- Tom: submit the app to the app store, by 1 June\n"
                "- Li: produce the demo video (voiceover by someone else)\n"
                "\n"
                "Next sync: 21 May, same time."
            ),
            (
                "Great, now write a short message I can post in the team Slack channel "
                "summarizing this, friendly tone, tagging people where their action items are."
            ),
        ),
        output_len=300,
    ),
    Conversation(
        topic="overfitting small dataset",
        turns=(
            (
                "I'm training a gradient boosting model on about 800 rows to predict customer "
                "churn. Training accuracy is 99 percent but validation is 71 percent. What can I "
                "do?"
            ),
            (
                "That gap is classic overfitting, and with 800 rows gradient boosting can easily "
                "memorize the training set. Things to try, roughly in order of impact:\n"
                "\n"
                "Constrain the trees: lower max_depth (2 to 4), raise min_child_weight or "
                "min_samples_leaf, and use subsample and colsample around 0.7 to 0.8.\n"
                "Use a smaller learning rate with early stopping on a validation set, instead of "
                "a fixed large number of trees.\n"
                "Use cross-validation rather than one split: with 800 rows, a single validation "
                "set gives noisy estimates.\n"
                "Check your features for leakage: anything computed after the churn event can "
                "make training look great and fail elsewhere.\n"
                "And compare against a simple baseline like logistic regression, which sometimes "
                "matches boosting on small data."
            ),
            (
                "I did 5-fold cross-validation with max_depth 3 and early stopping, and now I "
                "get about 78 percent on average. But only 15 percent of customers churn, so I "
                "realize accuracy might not be the right metric at all. Which metric should I "
                "use, how do I handle the class imbalance, and how do I choose the decision "
                "threshold for the business?"
            ),
        ),
        output_len=440,
    ),
    Conversation(
        topic="friend cancels plans",
        turns=(
            (
                "A close friend has cancelled plans with me four times in the last two months, "
                "always last minute with a vague excuse. I'm starting to feel like she doesn't "
                "want to be friends anymore, but we've known each other for 15 years. How do I "
                "bring it up without it turning into a fight?"
            ),
            (
                "It makes sense that this hurts, especially after 15 years. Going in curious "
                "rather than accusing gives you the best chance of a real conversation. Pick a "
                "calm moment, ideally in person or on a call rather than by text, and speak "
                "about your own experience: \"I've noticed our plans have fallen through a lot "
                'lately, and I miss you. Is everything okay with you?"\n'
                "\n"
                "That opens the door for her to share what is going on, whether that is stress, "
                "health, a relationship, or something about your friendship. Try to listen fully "
                "before explaining how it has affected you."
            ),
            (
                "I talked to her. She said she's been dealing with depression and didn't want to "
                "tell anyone, and that cancelling was about her, not me. I'm glad she told me "
                "but I don't really know how to support her. What should I do and not do?"
            ),
        ),
        output_len=300,
    ),
    Conversation(
        topic="balancing equations",
        turns=(
            (
                "How do I balance this chemical equation? C3H8 + O2 -> CO2 + H2O. I always end "
                "up going in circles."
            ),
            (
                "Balance the elements that appear in only one compound on each side first, and "
                "leave the one that appears as a pure element (oxygen here) for last.\n"
                "\n"
                "Carbon: 3 on the left, so put 3 in front of CO2.\n"
                "Hydrogen: 8 on the left, so 4 H2O gives 8 H.\n"
                "Oxygen: on the right there are 3 x 2 = 6 from CO2 plus 4 from H2O, which is 10 "
                "oxygen atoms, so 5 O2 on the left.\n"
                "\n"
                "C3H8 + 5 O2 -> 3 CO2 + 4 H2O"
            ),
            (
                "That worked. Can you show me the same method on a harder one, like the "
                "combustion of C2H6, where I think you end up with a fraction?"
            ),
        ),
        output_len=270,
    ),
    Conversation(
        topic="low light photography",
        turns=(
            (
                "My photos at indoor family parties always come out blurry or grainy. I have a "
                "Canon mirrorless camera with the kit lens. What settings should I use?"
            ),
            (
                "Indoors, the kit lens lets in little light, so the camera has to choose between "
                "a slow shutter (blur) and high ISO (grain). A few settings help: use shutter "
                "priority or manual with at least 1/125 s for moving people, let ISO go up to "
                "6400 (modern sensors handle it better than blurry shots do), open the aperture "
                "as wide as the lens allows, and turn on image stabilization. Shooting RAW lets "
                "you clean up noise later.\n"
                "\n"
                "The biggest upgrade is cheap: a 50 mm f/1.8 prime lens gathers roughly eight "
                "times more light than the kit lens at its long end."
            ),
            (
                "I bought the 50mm f/1.8. Now the faces are sharp but often only one person in a "
                "group is in focus and the others are blurry. Why does that happen and how do I "
                "fix it?"
            ),
        ),
        output_len=280,
    ),
    Conversation(
        topic="tenant deposit",
        turns=(
            (
                "I moved out of my apartment a month ago and the landlord is keeping 900 dollars "
                'of my 1,500 deposit for "cleaning and repainting". I lived there four years '
                "and left it clean. Is that allowed? I'm in California."
            ),
            (
                "I can't give legal advice, but here is general information about how this "
                "usually works in California. Landlords may deduct only for unpaid rent, "
                "cleaning needed to return the unit to its move-in level of cleanliness, and "
                "damage beyond normal wear and tear. After four years, some paint wear is "
                "generally considered normal wear and tear. Within 21 days of move-out, the "
                "landlord must send an itemized statement, and receipts or invoices for "
                "deductions over a certain amount.\n"
                "\n"
                "If you didn't get an itemized statement with documentation, or the charges look "
                "like normal wear and tear, you can send a written demand letter asking for the "
                "balance. Small claims court is the usual next step, and it doesn't require a "
                "lawyer."
            ),
            (
                'I got an itemized list but no receipts, just "cleaning 400, painting 500". I '
                "have move-out photos. Can you help me write a firm but polite demand letter "
                "asking for the 900 back?"
            ),
        ),
        output_len=340,
    ),
    Conversation(
        topic="rust borrow checker",
        turns=(
            (
                "I'm learning Rust and I don't understand this borrow checker error:\n"
                "\n"
                "fn main() {\n"
                "    let mut scores = vec![10, 20, 30];\n"
                "    let first = &scores[0];\n"
                "    scores.push(40);\n"
                '    println!("first score is {}", first);\n'
                "}\n"
                "\n"
                "error[E0502]: cannot borrow `scores` as mutable because it is also borrowed as "
                "immutable\n"
                "\n"
                "Why is this a problem? I'm only reading the first element."
            ),
            (
                "The issue is what push can do. When a Vec is full, push allocates a bigger "
                "buffer and moves all the elements there, freeing the old one. Your `first` "
                "reference points into the old buffer, so after the push it could be a dangling "
                "pointer. Rust prevents this at compile time: while an immutable borrow "
                "(`first`) is alive, nothing may mutate `scores`.\n"
                "\n"
                "Two easy fixes: copy the value instead of borrowing it (`let first = "
                "scores[0];` works because i32 is Copy), or finish using the reference before "
                "mutating, by moving the println! above the push."
            ),
            (
                "That makes sense for a Vec. But I hit a similar error with a struct where I "
                "have a method that takes &mut self and I want to call it while holding a "
                "reference to one of the struct's fields. How do people usually structure code "
                "to avoid fighting the borrow checker in that situation?"
            ),
        ),
        output_len=380,
    ),
    Conversation(
        topic="sci-fi recommendations",
        turns=(
            "I just finished The Expanse series and loved it. What should I read next?",
            (
                "If you liked The Expanse's mix of realistic physics, politics and characters, "
                "try:\n"
                "\n"
                "- The Murderbot Diaries by Martha Wells: short, funny, action-heavy.\n"
                "- Leviathan Wakes fans often enjoy Alastair Reynolds' Revelation Space, darker "
                "and more cosmic.\n"
                "- Adrian Tchaikovsky's Children of Time: evolution and first contact, very "
                "inventive.\n"
                "- Ann Leckie's Ancillary Justice: big-scale space empire politics from an "
                "unusual narrator.\n"
                "- Becky Chambers' The Long Way to a Small, Angry Planet: cozier, about a ship's "
                "crew as a family."
            ),
            (
                "I read Murderbot already and loved it. I'm in the mood for something with a big "
                "mystery at the center, like the protomolecule, and I don't mind if it's a bit "
                "slower. Which of these fits best, or is there something else?"
            ),
        ),
        output_len=300,
    ),
    Conversation(
        topic="procrastination",
        turns=(
            (
                "I'm a grad student and I procrastinate on writing my thesis every single day. I "
                "sit down, open the document, and then two hours later I've read news and "
                "cleaned my desk. I know what I need to write. How do I actually start?"
            ),
            (
                "When you know what to write and still can't start, the block is usually about "
                "the discomfort of starting, not about knowledge or time. Make starting tiny and "
                "concrete:\n"
                "\n"
                "Decide the night before exactly which paragraph you'll write first, and leave a "
                "half-finished sentence in the document so you start mid-thought.\n"
                'Work in short timed blocks, like 25 minutes, with the goal of "write badly" '
                'rather than "write well". Editing is a separate session.\n'
                "Remove the easy escapes: block news sites during writing blocks and put your "
                "phone in another room.\n"
                "Track something visible, like words written per day, so progress becomes real."
            ),
            (
                "The timer helps and I wrote 600 words yesterday. But today I read what I wrote "
                "and it's terrible and now I don't want to continue. How do I deal with that "
                "feeling, and should I fix yesterday's text first or keep going?"
            ),
        ),
        output_len=360,
    ),
    Conversation(
        topic="bash rename files",
        turns=(
            (
                "I have a folder with hundreds of photos named like IMG_20230514_143022.jpg. How "
                "can I rename them all to 2023-05-14_14-30-22.jpg with a bash script?"
            ),
            (
                "A simple loop with bash string slicing does it:\n"
                "\n"
                "for f in IMG_*.jpg; do\n"
                "  d=${f:4:8}; t=${f:13:6}\n"
                '  new="${d:0:4}-${d:4:2}-${d:6:2}_${t:0:2}-${t:2:2}-${t:4:2}.jpg"\n'
                '  mv -n -- "$f" "$new"\n'
                "done\n"
                "\n"
                "The -n flag refuses to overwrite an existing file, in case two photos were "
                "taken in the same second. Run it first with echo in front of mv to check the "
                "names before renaming anything."
            ),
            (
                "It worked for most files but some are named IMG_20230514_143022_1.jpg because "
                "of burst mode, and those got mangled. How do I handle both patterns and keep "
                "the burst number at the end?"
            ),
        ),
        output_len=260,
    ),
    Conversation(
        topic="explain recursion to beginner",
        turns=(
            (
                "I'm teaching a friend to code. How would you explain recursion to someone who "
                "has only written simple loops?"
            ),
            (
                "Start with something familiar: a set of Russian nesting dolls. To count the "
                "dolls, you open the outer one, count one, and then do the exact same thing with "
                "the doll you find inside, until you reach the smallest doll that doesn't open. "
                "That last one is the base case: the point where you stop and don't ask anything "
                "further.\n"
                "\n"
                "Then show a tiny function, like the sum of a list: the sum of an empty list is "
                "0 (base case), and otherwise it is the first element plus the sum of the rest. "
                "Trace it by hand on [1, 2, 3] on paper, writing each call on its own line."
            ),
            (
                "Good idea with the dolls. What are the most common mistakes beginners make with "
                "recursion, and a couple of small exercises I can give her that go from easy to "
                "slightly harder?"
            ),
        ),
        output_len=240,
    ),
    Conversation(
        topic="houseplant light",
        turns=(
            (
                "My fiddle leaf fig keeps dropping leaves. It's about 3 meters from a "
                "north-facing window. What's wrong?"
            ),
            (
                "Three meters from a north window is very little light for a fiddle leaf fig, "
                "which wants bright, indirect light for most of the day. Leaf drop is its "
                "typical reaction to too little light, often combined with overwatering because "
                "the soil stays wet longer in low light. Move it as close to the brightest "
                "window as you can, ideally east or south facing, and water only when the top "
                "few centimeters of soil are dry."
            ),
            (
                "I moved it to an east window yesterday. Should I expect it to drop more leaves "
                "because of the move?"
            ),
        ),
        output_len=180,
    ),
    Conversation(
        topic="learn touch typing",
        turns=(
            (
                "I'm 45 and still type with two fingers. Is it too late to learn touch typing, "
                "and how long will it take?"
            ),
            (
                "It is definitely not too late. Most adults who practice 15 to 20 minutes a day "
                "reach their old two-finger speed within three to six weeks and pass it after "
                "that. Use a free tool like keybr or Typing.com, don't look at the keyboard even "
                "when it's painfully slow, and focus on accuracy before speed."
            ),
            (
                "Should I keep typing the old way at work while I learn, or switch completely "
                "right away?"
            ),
        ),
        output_len=160,
    ),
    Conversation(
        topic="cover letter career change",
        turns=(
            (
                "I'm switching careers from high school chemistry teacher (8 years) to "
                "instructional designer at tech companies. I've done a certificate in "
                "instructional design and built a portfolio with three e-learning modules in "
                "Articulate Storyline. Can you help me write a cover letter for a junior "
                "instructional designer role at a software company that makes project management "
                "tools? The posting emphasizes creating onboarding courses for new customers, "
                "working with subject matter experts, and measuring training effectiveness."
            ),
            (
                "Here is a draft built around the three things the posting emphasizes:\n"
                "\n"
                "Dear Hiring Team,\n"
                "\n"
                "For eight years I designed learning experiences for some of the toughest "
                "audiences there are: teenagers learning chemistry. I'm now bringing that "
                "experience to instructional design, and your Junior Instructional Designer "
                "role, focused on onboarding new customers, is exactly where I want to apply "
                "it.\n"
                "\n"
                "In the classroom I turned complex material into clear, step-by-step sequences, "
                "and I measured whether it worked: I redesigned our introductory unit around "
                "short practice checks and raised first-attempt pass rates on our unit tests. "
                "Since completing my instructional design certificate, I have built three "
                "e-learning modules in Articulate Storyline, including a customer-style software "
                "walkthrough, which you can see in my portfolio.\n"
                "\n"
                "I also know how to work with subject matter experts, having co-written "
                "curriculum with university partners and colleagues across departments.\n"
                "\n"
                "I'd love to talk about how I could help your new customers get value from your "
                "product faster."
            ),
            (
                "This is good, but the line about raising pass rates sounds made up unless I "
                "have numbers. I do have numbers: first-attempt pass rates went from 62 to 78 "
                "percent over two years. Also can you make the opening less cliché and cut it to "
                "around 250 words?"
            ),
        ),
        output_len=450,
    ),
    Conversation(
        topic="australia capital trivia",
        turns=(
            "Quick question: what's the capital of Australia? Is it Sydney or Melbourne?",
            (
                "Neither: it's Canberra. When Australia federated in 1901, Sydney and Melbourne "
                "both wanted to be the capital, so as a compromise a new city was built between "
                "them. Parliament moved to Canberra in 1927."
            ),
            "Interesting! Was Canberra designed from scratch like Brasilia or Washington?",
            (
                "Yes. It was planned from scratch after an international design competition in "
                "1911-1912, won by the American architects Walter Burley Griffin and Marion "
                "Mahony Griffin. Their plan arranged the city around a central artificial lake "
                "and geometric axes lined up with the surrounding hills."
            ),
            "Cool. Is the lake named after them, or after someone else?",
        ),
        output_len=120,
    ),
    Conversation(
        topic="weekly meal prep",
        turns=(
            ("Can you give me a simple vegetarian meal prep plan for lunches, Monday to Friday?"),
            (
                "Sure. Cook two bases on Sunday and mix them differently during the week:\n"
                "\n"
                "Base 1: a big tray of roasted vegetables (sweet potato, peppers, zucchini, red "
                "onion) and a pot of quinoa.\n"
                "Base 2: a pot of lentil and chickpea curry.\n"
                "\n"
                "Monday and Tuesday: quinoa bowls with roasted vegetables, feta and a "
                "lemon-tahini dressing.\n"
                "Wednesday and Thursday: curry with rice or naan, plus a handful of spinach "
                "stirred in.\n"
                "Friday: wraps with leftover roasted vegetables, hummus and any remaining "
                "chickpeas."
            ),
            "Nice. How long will the curry keep in the fridge? Should I freeze part of it?",
            (
                "Cooked curry keeps about 3 to 4 days in the fridge in a sealed container, so it "
                "will be fine for Wednesday and Thursday if you make it on Sunday. Freezing half "
                "is a good idea if you want Thursday's portion to taste fresher; it freezes well "
                "for up to three months. Thaw it overnight in the fridge and reheat until "
                "steaming."
            ),
            (
                "Great. Can you give me a shopping list for the whole plan, for one person, "
                "organized by supermarket section?"
            ),
        ),
        output_len=300,
    ),
    Conversation(
        topic="short chat about tea",
        turns=(
            "Is green tea actually healthier than black tea or is that just marketing?",
            (
                "Both come from the same plant, Camellia sinensis; black tea is oxidized and "
                "green tea is not. Green tea keeps more catechins like EGCG, while black tea has "
                "more theaflavins. Studies link both to modest benefits, mainly for heart "
                "health, and the differences between them are small. Drinking whichever one you "
                "enjoy regularly, without much sugar, matters more than which color it is."
            ),
            ("What about caffeine? I want something for the afternoon that won't keep me awake."),
            (
                "Typically a cup of black tea has about 40 to 70 mg of caffeine and green tea "
                "about 20 to 45 mg, compared with around 95 mg in a cup of coffee, though it "
                "varies with the leaves and brewing time. For the afternoon, green tea or a "
                "shorter brew helps, and caffeine-free herbal teas like rooibos or chamomile are "
                "the safest choice if you're sensitive."
            ),
            "Does steeping the tea for a shorter time really lower the caffeine that much?",
        ),
        output_len=150,
    ),
    Conversation(
        topic="debugging flaky test",
        turns=(
            (
                "We have a test that fails about one run in twenty on CI but never on my "
                "machine. Where do I even begin?"
            ),
            (
                "Flaky tests almost always come from one of a few sources: timing (sleeps, "
                "timeouts, race conditions), shared state between tests (order dependence, "
                "leftover files or database rows), randomness without a fixed seed, or the "
                "environment (time zones, locale, CPU speed, parallelism). Start by collecting "
                "information: run the test in a loop locally, run it with the same parallelism "
                "and random test ordering as CI, and save logs from failing CI runs."
            ),
            (
                "Running it 200 times in a loop locally it failed 3 times. The failure is an "
                "assertion that a list has 5 items but it has 4. The test starts a background "
                "worker that processes jobs and then checks the results table."
            ),
            (
                "That pattern suggests a race: the test checks the results table before the "
                "background worker has finished the last job. On your machine the worker is "
                "usually fast enough; on a busy CI machine it sometimes is not. Look for a fixed "
                "sleep or a check that happens right after enqueueing. The fix is to wait for a "
                "condition instead of a duration: poll until 5 rows exist, with a generous "
                "timeout, or have the worker expose a way to wait until the queue is drained."
            ),
            (
                "There is indeed a sleep(0.5) before the assertion. What's a clean way to write "
                "a reusable wait-until helper in Python for tests, with a timeout and a good "
                "error message when it gives up?"
            ),
        ),
        output_len=360,
    ),
)
